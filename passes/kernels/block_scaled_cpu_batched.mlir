{#- y[n, j] = x[n, j] @ W[j]^T for FP8 / INT4 weights on llvm-cpu, N > 1 rows (prefill): W[j] through
    indexing maps, each weight's decode shared by the nt rows of n in a vector tile (passes/block_scaled.py
    `cpu_function`). J == 1 (one expert: a linear layer) drops the j dim (IREE would rebuild an op with a
    unit dim and lose its lowering_config).
    params: name, fmt, N, J, K, O, E, G, lanes, packed_t, packed_el, scales_t, info -#}
{% import "block_scaled_cpu_common.mlir" as common %}
{% set jd = "j, " if J > 1 else "" %}
{% set jsh = "%dx" % J if J > 1 else "" %}
{% set d = jd ~ "o, n, b, g" %}
{% set e = "%j" if J > 1 else "%c0" %}
{% set per_element = fmt != "int4_g32" %}
{% set wcols = "%dx%d" % (G, lanes) if per_element else "%d" % G %}
{% set wmap = jd ~ ("o, g, b" if per_element else "o, g") %}
{% set xs, ws, ps = "%dx%s%dx%d" % (N, jsh, G, lanes), jsh ~ "%dx%s" % (O, wcols), "%s%dx%dx%d" % (jsh, O, N, lanes) %}
util.func private @{{name}}(%x: tensor<{{N}}x{{J}}x{{K}}xf32>, %packed: {{packed_t}}{% if scales_t %}, %scales: {{scales_t}}{% endif %})
    -> tensor<{{N}}x{{J}}x{{O}}xf32> {
  %c0f = arith.constant 0.0 : f32
  %c0 = arith.constant 0 : index
{% if J > 1 %}
  %xl = tensor.expand_shape %x [[0], [1], [2, 3]] output_shape [{{N}}, {{J}}, {{G}}, {{lanes}}]
      : tensor<{{N}}x{{J}}x{{K}}xf32> into tensor<{{xs}}xf32>
{% else %}
  %xc = tensor.collapse_shape %x [[0, 1], [2]] : tensor<{{N}}x{{J}}x{{K}}xf32> into tensor<{{N}}x{{K}}xf32>
  %xl = tensor.expand_shape %xc [[0], [1, 2]] output_shape [{{N}}, {{G}}, {{lanes}}]
      : tensor<{{N}}x{{K}}xf32> into tensor<{{xs}}xf32>
{% endif %}
{% if per_element and J > 1 %}
  %w = tensor.expand_shape %packed [[0], [1], [2, 3]] output_shape [{{E}}, {{O}}, {{G}}, {{lanes}}]
      : {{packed_t}} into tensor<{{ws}}x{{packed_el}}>
{% elif per_element %}
  %wc = tensor.collapse_shape %packed [[0, 1], [2]] : {{packed_t}} into tensor<{{O}}x{{K}}x{{packed_el}}>
  %w = tensor.expand_shape %wc [[0], [1, 2]] output_shape [{{O}}, {{G}}, {{lanes}}]
      : tensor<{{O}}x{{K}}x{{packed_el}}> into tensor<{{ws}}x{{packed_el}}>
{% elif J == 1 %}
  %w = tensor.collapse_shape %packed [[0, 1], [2]] : {{packed_t}} into tensor<{{ws}}x{{packed_el}}>
{% endif %}
  %p0 = tensor.empty() : tensor<{{ps}}xf32>
  %pz = linalg.fill ins(%c0f : f32) outs(%p0 : tensor<{{ps}}xf32>) -> tensor<{{ps}}xf32>
  // part[j, o, n, b] = sum_g w(j, o, g*lanes + b) * x[n, j, g*lanes + b]
  %part = linalg.generic {indexing_maps = [affine_map<({{d}}) -> (n, {{jd}}g, b)>, affine_map<({{d}}) -> ({{wmap}})>,
                                          affine_map<({{d}}) -> ({{jd}}o, n, b)>],
                          iterator_types = [{{ (['"parallel"'] * (4 if J > 1 else 3)) | join(", ") }}, "reduction"],
                          {{info}}}
      ins(%xl, {{ "%packed" if not per_element and J > 1 else "%w" }} : tensor<{{xs}}xf32>, tensor<{{ws}}x{{packed_el}}>) outs(%pz : tensor<{{ps}}xf32>) {
    ^bb0(%xv: f32, %code: {{packed_el}}, %acc: f32):
{% if J > 1 %}
      %j = linalg.index 0 : index
{% endif %}
      %o = linalg.index {{1 if J > 1 else 0}} : index
      %b = linalg.index {{3 if J > 1 else 2}} : index
      %g = linalg.index {{4 if J > 1 else 3}} : index
{{ common.weight(fmt, e, lanes, scales_t) }}
      %fnz = arith.constant -0.0 : f32
      %p = math.fma %wv, %xv, %fnz : f32
      %r = arith.addf %p, %acc : f32
      linalg.yield %r : f32
  } -> tensor<{{ps}}xf32>
  // stage 2: y[n, j, o] = sum_b part[j, o, n, b]
  %y0 = tensor.empty() : tensor<{{N}}x{{jsh}}{{O}}xf32>
  %yz = linalg.fill ins(%c0f : f32) outs(%y0 : tensor<{{N}}x{{jsh}}{{O}}xf32>) -> tensor<{{N}}x{{jsh}}{{O}}xf32>
  %ym = linalg.generic {indexing_maps = [affine_map<(n, {{jd}}o, b) -> ({{jd}}o, n, b)>,
                                        affine_map<(n, {{jd}}o, b) -> (n, {{jd}}o)>],
                       iterator_types = [{{ (['"parallel"'] * (3 if J > 1 else 2)) | join(", ") }}, "reduction"]}
      ins(%part : tensor<{{ps}}xf32>) outs(%yz : tensor<{{N}}x{{jsh}}{{O}}xf32>) {
    ^bb0(%a: f32, %acc: f32):
      %r = arith.addf %a, %acc : f32
      linalg.yield %r : f32
  } -> tensor<{{N}}x{{jsh}}{{O}}xf32>
{% if J > 1 %}
  util.return %ym : tensor<{{N}}x{{J}}x{{O}}xf32>
{% else %}
  %y = tensor.expand_shape %ym [[0, 1], [2]] output_shape [{{N}}, 1, {{O}}] : tensor<{{N}}x{{O}}xf32> into tensor<{{N}}x{{J}}x{{O}}xf32>
  util.return %y : tensor<{{N}}x{{J}}x{{O}}xf32>
{% endif %}
}
