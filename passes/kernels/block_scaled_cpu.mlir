{#- y[n, j] = x[n, j] @ W[e(n, j)]^T for FP8 (fp8_e4m3_b128) and INT4 (int4_g32) weights on llvm-cpu
    (passes/block_scaled.py `cpu_function` says why it is shaped so); also a plain bf16 weight (fmt bf16, no scales). K is split into G steps of `lanes` contiguous
    elements: the lanes are a parallel vector, G the reduction, a second generic sums the lanes.
    params: name, fmt, N, J, K, O, E, M (= N*J), G, lanes, single (M == 1), expert0 (no experts operand:
            the batched unit's one expert), packed_t, packed_el, scales_t,
            info (the part generic's compilation_info) -#}
{% import "block_scaled_cpu_common.mlir" as common %}
{% set md = "" if single else "m, " %}
{% set rowsh = "" if single else "%dx" % M %}
{% set xs, ps, ys = "%s%dx%d" % (rowsh, G, lanes), "%s%dx%d" % (rowsh, O, lanes), "%s%d" % (rowsh, O) %}
{% set d = md ~ "o, b, g" %}
{% set e = "%e0" if single else "%e" %}
{% set per_element = fmt != "int4_g32" %}
{% set wcols = "%dx%d" % (G, lanes) if per_element else "%d" % G %}
{% set wmap = md ~ ("o, g, b" if per_element else "o, g") %}
util.func private @{{name}}(%x: tensor<{{N}}x{{J}}x{{K}}xf32>, %packed: {{packed_t}}
    {%- if scales_t %}, %scales: {{scales_t}}{% endif %}{% if not expert0 %}, %experts: tensor<{{N}}x{{J}}xi64>{% endif %}) -> tensor<{{N}}x{{J}}x{{O}}xf32> {
  %c0f = arith.constant 0.0 : f32
  %c0 = arith.constant 0 : index
{% if single %}
  %xk = tensor.collapse_shape %x [[0, 1, 2]] : tensor<{{N}}x{{J}}x{{K}}xf32> into tensor<{{K}}xf32>
  %xl = tensor.expand_shape %xk [[0, 1]] output_shape [{{G}}, {{lanes}}] : tensor<{{K}}xf32> into tensor<{{xs}}xf32>
{% if expert0 %}
  %e0 = arith.constant 0 : index
{% else %}
  %ei0 = tensor.extract %experts[%c0, %c0] : tensor<{{N}}x{{J}}xi64>
  %e0 = arith.index_cast %ei0 : i64 to index
{% endif %}
  // the one selected expert: a dynamic-offset slice (only its bytes are read)
{% if per_element %}
  %wsel = tensor.extract_slice %packed[%e0, 0, 0] [1, {{O}}, {{K}}] [1, 1, 1] : {{packed_t}} to tensor<{{O}}x{{K}}x{{packed_el}}>
  %w = tensor.expand_shape %wsel [[0], [1, 2]] output_shape [{{O}}, {{G}}, {{lanes}}]
      : tensor<{{O}}x{{K}}x{{packed_el}}> into tensor<{{O}}x{{wcols}}x{{packed_el}}>
{% else %}
  %w = tensor.extract_slice %packed[%e0, 0, 0] [1, {{O}}, {{G}}] [1, 1, 1] : {{packed_t}} to tensor<{{O}}x{{G}}xi32>
{% endif %}
{% else %}
  %xc = tensor.collapse_shape %x [[0, 1], [2]] : tensor<{{N}}x{{J}}x{{K}}xf32> into tensor<{{M}}x{{K}}xf32>
  %xl = tensor.expand_shape %xc [[0], [1, 2]] output_shape [{{M}}, {{G}}, {{lanes}}]
      : tensor<{{M}}x{{K}}xf32> into tensor<{{xs}}xf32>
  %em = tensor.collapse_shape %experts [[0, 1]] : tensor<{{N}}x{{J}}xi64> into tensor<{{M}}xi64>
{% if per_element %}
  %pk = tensor.expand_shape %packed [[0], [1], [2, 3]] output_shape [{{E}}, {{O}}, {{G}}, {{lanes}}]
      : {{packed_t}} into tensor<{{E}}x{{O}}x{{wcols}}x{{packed_el}}>
{% endif %}
  // packed[experts[m]]: fused into the consumer dispatch (no materialised copy)
  %w0 = tensor.empty() : tensor<{{M}}x{{O}}x{{wcols}}x{{packed_el}}>
  %w = iree_linalg_ext.gather dimension_map = [0] ins({{ "%pk" if per_element else "%packed" }}, %em : tensor<{{E}}x{{O}}x{{wcols}}x{{packed_el}}>, tensor<{{M}}xi64>)
      outs(%w0 : tensor<{{M}}x{{O}}x{{wcols}}x{{packed_el}}>) -> tensor<{{M}}x{{O}}x{{wcols}}x{{packed_el}}>
{% endif %}
  %p0 = tensor.empty() : tensor<{{ps}}xf32>
  %pz = linalg.fill ins(%c0f : f32) outs(%p0 : tensor<{{ps}}xf32>) -> tensor<{{ps}}xf32>
  // part[m, o, b] = sum_g w(e, o, g*lanes + b) * x[m, g*lanes + b]
  %part = linalg.generic {indexing_maps = [affine_map<({{d}}) -> ({{md}}g, b)>, affine_map<({{d}}) -> ({{wmap}})>,
                                          affine_map<({{d}}) -> ({{md}}o, b)>],
                          iterator_types = [{{ (['"parallel"'] * (2 if single else 3)) | join(", ") }}, "reduction"],
                          {{info}}}
      ins(%xl, %w : tensor<{{xs}}xf32>, tensor<{{rowsh}}{{O}}x{{wcols}}x{{packed_el}}>)
      outs(%pz : tensor<{{ps}}xf32>) {
    ^bb0(%xv: f32, %code: {{packed_el}}, %acc: f32):
{% if not single %}
      %mi = linalg.index 0 : index
      %ei = tensor.extract %em[%mi] : tensor<{{M}}xi64>
      %e = arith.index_cast %ei : i64 to index
{% endif %}
      %o = linalg.index {{0 if single else 1}} : index
      %b = linalg.index {{1 if single else 2}} : index
      %g = linalg.index {{2 if single else 3}} : index
{{ common.weight(fmt, e, lanes, scales_t) }}
      // written as an fma with -0.0 (== wv * x exactly) so that the vectoriser builds no vector.contract
      %fnz = arith.constant -0.0 : f32
      %p = math.fma %wv, %xv, %fnz : f32
      %r = arith.addf %p, %acc : f32
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
