{#- y[n, j] = x[n, j] @ W[experts[n, j]]^T for CPUs without AVX-512 (passes/mxfp4_cpu.py says why).
    single: M == N*J == 1 (no m dim: a unit dim would make IREE rebuild the op and drop the config).
    params: name, N, J, K, O, E, G, K2, M, single, info (the part generic's compilation_info),
            deinterleave (the macro's arguments) -#}
{% import "mxfp4_cpu_common.mlir" as common %}
{% set md = "" if single else "m, " %}
{% set rowsh = "" if single else "%dx" % M %}
{% set xs, ps, ys = "%s%dx16" % (rowsh, G), "%s%dx16" % (rowsh, O), "%s%d" % (rowsh, O) %}
{% set d = md ~ "o, b, g" %}
util.func private @{{name}}(%x: tensor<{{N}}x{{J}}x{{K}}xf32>, %packed: tensor<{{E}}x{{O}}x{{K2}}xi8>,
    %scales: tensor<{{E}}x{{O}}x{{G}}xi8>, %experts: tensor<{{N}}x{{J}}xi64>) -> tensor<{{N}}x{{J}}x{{O}}xf32> {
  %c0f = arith.constant 0.0 : f32
{% if single %}
  %c0 = arith.constant 0 : index
  %xm = tensor.collapse_shape %x [[0, 1, 2]] : tensor<{{N}}x{{J}}x{{K}}xf32> into tensor<{{K}}xf32>
  %ei0 = tensor.extract %experts[%c0, %c0] : tensor<{{N}}x{{J}}xi64>
  %e0 = arith.index_cast %ei0 : i64 to index
{% else %}
  %xm = tensor.collapse_shape %x [[0, 1], [2]] : tensor<{{N}}x{{J}}x{{K}}xf32> into tensor<{{M}}x{{K}}xf32>
  %em = tensor.collapse_shape %experts [[0, 1]] : tensor<{{N}}x{{J}}xi64> into tensor<{{M}}xi64>
{% endif %}
{{ common.deinterleave(**deinterleave) }}
  %pk = tensor.expand_shape %packed [[0], [1], [2, 3]] output_shape [{{E}}, {{O}}, {{G}}, 16]
      : tensor<{{E}}x{{O}}x{{K2}}xi8> into tensor<{{E}}x{{O}}x{{G}}x16xi8>
{% if single %}
  // the one selected expert: a dynamic-offset slice (only its bytes are read)
  %wsel = tensor.extract_slice %pk[%e0, 0, 0, 0] [1, {{O}}, {{G}}, 16] [1, 1, 1, 1]
      : tensor<{{E}}x{{O}}x{{G}}x16xi8> to tensor<{{O}}x{{G}}x16xi8>
{% else %}
  // packed[experts[m]] -> [M, O, G, 16]; fused into the consumer dispatch, one 16-byte load per block
  %wsel0 = tensor.empty() : tensor<{{M}}x{{O}}x{{G}}x16xi8>
  %wsel = iree_linalg_ext.gather dimension_map = [0] ins(%pk, %em : tensor<{{E}}x{{O}}x{{G}}x16xi8>, tensor<{{M}}xi64>)
      outs(%wsel0 : tensor<{{M}}x{{O}}x{{G}}x16xi8>) -> tensor<{{M}}x{{O}}x{{G}}x16xi8>
{% endif %}
  %p0 = tensor.empty() : tensor<{{ps}}xf32>
  %pz = linalg.fill ins(%c0f : f32) outs(%p0 : tensor<{{ps}}xf32>) -> tensor<{{ps}}xf32>
  // stage 1: part[m, o, b] = sum_g blockfactor(s[e,o,g]) * (xe[m,g,b]*lo(w[m,o,g,b]) + xo[m,g,b]*hi(w[m,o,g,b]))
  // b is a parallel 16-lane vector, g the (scalar-loop) reduction
  %part = linalg.generic {indexing_maps = [affine_map<({{d}}) -> ({{md}}g, b)>, affine_map<({{d}}) -> ({{md}}g, b)>,
                                          affine_map<({{d}}) -> ({{md}}o, g, b)>, affine_map<({{d}}) -> ({{md}}o, b)>],
                          iterator_types = [{{ (['"parallel"'] * (2 if single else 3)) | join(", ") }}, "reduction"],
                          {{info}}}
      ins(%xe, %xo, %wsel : tensor<{{xs}}xf32>, tensor<{{xs}}xf32>, tensor<{{rowsh}}{{O}}x{{G}}x16xi8>)
      outs(%pz : tensor<{{ps}}xf32>) {
    ^bb0(%xev: f32, %xov: f32, %w8: i8, %acc: f32):
{% if single %}
      %ei = tensor.extract %experts[%c0, %c0] : tensor<{{N}}x{{J}}xi64>
{% else %}
      %mi = linalg.index 0 : index
      %ei = tensor.extract %em[%mi] : tensor<{{M}}xi64>
{% endif %}
      %e = arith.index_cast %ei : i64 to index
      %o = linalg.index {{0 if single else 1}} : index
      %g = linalg.index {{2 if single else 3}} : index
      %s8 = tensor.extract %scales[%e, %o, %g] : tensor<{{E}}x{{O}}x{{G}}xi8>
      %s = arith.extui %s8 : i8 to i32
{{ common.decode() }}
      %p1 = arith.mulf %xev, %lo : f32
      %p2 = math.fma %xov, %hi, %p1 : f32
      %p2g = arith.mulf %p2, %gf : f32
      // == p2g * f; written as an fma so that the vectoriser does not build a vector.contract
      %p3 = math.fma %p2g, %f, %fnz : f32
      %r = arith.addf %p3, %acc : f32
      linalg.yield %r : f32
  } -> tensor<{{ps}}xf32>
  // stage 2: y[m, o] = sum_b part[m, o, b]
  %y0 = tensor.empty() : tensor<{{ys}}xf32>
  %yz = linalg.fill ins(%c0f : f32) outs(%y0 : tensor<{{ys}}xf32>) -> tensor<{{ys}}xf32>
  %ym = linalg.generic {indexing_maps = [affine_map<({{md}}o, b) -> ({{md}}o, b)>, affine_map<({{md}}o, b) -> ({{md}}o)>],
                       iterator_types = [{{ (['"parallel"'] * (1 if single else 2)) | join(", ") }}, "reduction"]}
      ins(%part : tensor<{{ps}}xf32>) outs(%yz : tensor<{{ys}}xf32>) {
    ^bb0(%a: f32, %acc: f32):
      %r = arith.addf %a, %acc : f32
      linalg.yield %r : f32
  } -> tensor<{{ys}}xf32>
{% if single %}
  %y = tensor.expand_shape %ym [[0, 1, 2]] output_shape [{{N}}, {{J}}, {{O}}] : tensor<{{O}}xf32> into tensor<{{N}}x{{J}}x{{O}}xf32>
{% else %}
  %y = tensor.expand_shape %ym [[0, 1], [2]] output_shape [{{N}}, {{J}}, {{O}}] : tensor<{{M}}x{{O}}xf32> into tensor<{{N}}x{{J}}x{{O}}xf32>
{% endif %}
  util.return %y : tensor<{{N}}x{{J}}x{{O}}xf32>
}
