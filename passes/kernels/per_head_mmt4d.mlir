{#- y[n, h] = widen(W[h]) @ x[n, h] for MLA's absorbed projections on a block of rows (passes/weights.py
    `per_head_function` says why): IREE's packed matmul form written out. The weight, widened and packed to
    [H, O1, K, N0, 1], depends only on a parameter (IREE hoists it into the module's initializer); the rows
    are packed per call to [H, N1, K, M0, 1], each head's tiles multiplied by linalg.batch_mmt4d, and the
    result unpacked. Padding (rows past N, outputs past O) is zero and dropped by the unpack.
    params: name, N, H, K, O, M0, N0 (tile sizes), N1, O1 (tile counts) -#}
{% set xt, wt, yt = "tensor<%dx%dx%dxf32>" % (N, H, K), "tensor<%dx%dx%dxbf16>" % (H, O, K), "tensor<%dx%dx%dxf32>" % (N, H, O) %}
{% set wft, rpt = "tensor<%dx%dx%dxf32>" % (H, O, K), "tensor<%dx%dx%dx%dx1xf32>" % (H, O1, K, N0) %}
{% set lpt, acct = "tensor<%dx%dx%dx%dx1xf32>" % (H, N1, K, M0), "tensor<%dx%dx%dx%dx%dxf32>" % (H, N1, O1, M0, N0) %}
util.func private @{{name}}(%x: {{xt}}, %w: {{wt}}) -> {{yt}} {
  %zero = arith.constant 0.0 : f32
  %wf0 = tensor.empty() : {{wft}}
  %wf = linalg.generic {indexing_maps = [affine_map<(h, o, k) -> (h, o, k)>, affine_map<(h, o, k) -> (h, o, k)>],
                        iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%w : {{wt}}) outs(%wf0 : {{wft}}) {
    ^bb0(%b: bf16, %unused: f32):
      %f = arith.extf %b : bf16 to f32
      linalg.yield %f : f32
  } -> {{wft}}
  %rp0 = tensor.empty() : {{rpt}}
  %rp = linalg.pack %wf padding_value(%zero : f32) inner_dims_pos = [1, 2] inner_tiles = [{{N0}}, 1]
      into %rp0 : {{wft}} -> {{rpt}}
  %lp0 = tensor.empty() : {{lpt}}
  %lp = linalg.pack %x padding_value(%zero : f32) outer_dims_perm = [1, 0, 2] inner_dims_pos = [0, 2] inner_tiles = [{{M0}}, 1]
      into %lp0 : {{xt}} -> {{lpt}}
  %acc0 = tensor.empty() : {{acct}}
  %accz = linalg.fill ins(%zero : f32) outs(%acc0 : {{acct}}) -> {{acct}}
  %acc = linalg.batch_mmt4d ins(%lp, %rp : {{lpt}}, {{rpt}}) outs(%accz : {{acct}}) -> {{acct}}
  %y0 = tensor.empty() : {{yt}}
  %y = linalg.unpack %acc outer_dims_perm = [1, 0, 2] inner_dims_pos = [0, 2] inner_tiles = [{{M0}}, {{N0}}]
      into %y0 : {{acct}} -> {{yt}}
  util.return %y : {{yt}}
}
