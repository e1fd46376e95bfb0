{#- y[n, j] = x[n, j] @ W[j]^T for CPUs without AVX-512 (passes/mxfp4_cpu.py): W[j] through indexing maps,
    each block's decode shared by nt rows of n, ot rows of o per tile; no experts operand.
    params: name, N, J, K, O, E, G, K2, D (the part generic's dims), maps (its indexing maps by operand),
            iterators, info, shapes (xs, ws, ss, ps, ys), y_dims, y_out, y_iterators, deinterleave, reflat -#}
{% import "mxfp4_cpu_common.mlir" as common %}
util.func private @{{name}}(%x: tensor<{{N}}x{{J}}x{{K}}xf32>, %packed: tensor<{{E}}x{{O}}x{{K2}}xi8>,
    %scales: tensor<{{E}}x{{O}}x{{G}}xi8>) -> tensor<{{N}}x{{J}}x{{O}}xf32> {
  %c0f = arith.constant 0.0 : f32
{{ common.reflat(**reflat.x) }}
{{ common.deinterleave(**deinterleave) }}
{{ common.reflat(**reflat.packed) }}
{{ common.reflat(**reflat.scales) }}
  %p0 = tensor.empty() : tensor<{{ps}}xf32>
  %pz = linalg.fill ins(%c0f : f32) outs(%p0 : tensor<{{ps}}xf32>) -> tensor<{{ps}}xf32>
  %part = linalg.generic {indexing_maps = [affine_map<{{D}} -> {{maps.x}}>, affine_map<{{D}} -> {{maps.x}}>,
                                          affine_map<{{D}} -> {{maps.w}}>, affine_map<{{D}} -> {{maps.s}}>,
                                          affine_map<{{D}} -> {{maps.part}}>],
                          iterator_types = [{{iterators}}],
                          {{info}}}
      ins(%xe, %xo, %pk, %sc : tensor<{{xs}}xf32>, tensor<{{xs}}xf32>, tensor<{{ws}}xi8>, tensor<{{ss}}xi8>)
      outs(%pz : tensor<{{ps}}xf32>) {
    ^bb0(%xev: f32, %xov: f32, %w8: i8, %s8: i8, %acc: f32):
      %s = arith.extui %s8 : i8 to i32
{{ common.decode() }}
      // g (1/2 or 1, exact) folded into the decoded weights once per block (shared by the nt rows);
      // f applied to each row's block partial
      %log = arith.mulf %lo, %gf : f32
      %hig = arith.mulf %hi, %gf : f32
      %p1 = arith.mulf %xev, %log : f32
      %p2 = math.fma %xov, %hig, %p1 : f32
      %p3 = math.fma %p2, %f, %fnz : f32
      %r = arith.addf %p3, %acc : f32
      linalg.yield %r : f32
  } -> tensor<{{ps}}xf32>
  %ye = tensor.empty() : tensor<{{ys}}xf32>
  %yz = linalg.fill ins(%c0f : f32) outs(%ye : tensor<{{ys}}xf32>) -> tensor<{{ys}}xf32>
  %ym = linalg.generic {indexing_maps = [affine_map<{{y_dims}} -> {{maps.part}}>, affine_map<{{y_dims}} -> {{y_out}}>],
                       iterator_types = [{{y_iterators}}]}
      ins(%part : tensor<{{ps}}xf32>) outs(%yz : tensor<{{ys}}xf32>) {
    ^bb0(%a: f32, %acc: f32):
      %r = arith.addf %a, %acc : f32
      linalg.yield %r : f32
  } -> tensor<{{ys}}xf32>
{{ common.reflat(**reflat.y) }}
  util.return %y : tensor<{{N}}x{{J}}x{{O}}xf32>
}
