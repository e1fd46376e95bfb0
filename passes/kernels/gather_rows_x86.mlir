{#- The selected cache rows of one decode query on x86 (passes/sparse_attention.py step 5): for j < K,
      rows[b, 0, j] = latent[b, idx[b, 0, j]],  rows_pe[b, 0, j] = k_pe[b, idx[b, 0, j]]
    one row a loop step as whole vectors; IREE's own gather (a generic with tensor.extract) ran at about
    a fifth of this host's bandwidth.
    gather:   {{name}}(idx [B, 1, K] i32, latent [B, S, R], k_pe [B, S, P] f32) -> ([B, 1, K, R], [B, 1, K, P])
    params:   name, B, S, K, R, P, width, CH (rows a workgroup) -#}
{% set fn = name ~ "_rows" %}
{% set it, lt, pt, rt, qt = "tensor<%dx1x%dxi32>" % (B, K), "tensor<%dx%dx%dxf32>" % (B, S, R), "tensor<%dx%dx%dxf32>" % (B, S, P), "tensor<%dx1x%dx%dxf32>" % (B, K, R), "tensor<%dx1x%dx%dxf32>" % (B, K, P) %}
{% set im, lm, pm, rm, qm = it | replace("tensor", "memref"), lt | replace("tensor", "memref"), pt | replace("tensor", "memref"), rt | replace("tensor", "memref"), qt | replace("tensor", "memref") %}
{% set vf = "vector<%dxf32>" % width %}
stream.executable private @{{fn}}_dispatch {
  stream.executable.export public @{{fn}} workgroups() -> (index, index, index) {
    %x = arith.constant {{B * K // CH}} : index
    %c1 = arith.constant 1 : index
    stream.return %x, %c1, %c1 : index, index, index
  }
  builtin.module {
    func.func @{{fn}}(%idx_b: !stream.binding, %lat_b: !stream.binding, %pe_b: !stream.binding, %rows_b: !stream.binding,
                      %rows_pe_b: !stream.binding) {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c_chunks = arith.constant {{K // CH}} : index
      %c_ch = arith.constant {{CH}} : index
      %c_r = arith.constant {{R}} : index
      %c_p = arith.constant {{P}} : index
      %c_w = arith.constant {{width}} : index
      %idx = stream.binding.subspan %idx_b[%c0] : !stream.binding -> {{im}}
      %lat = stream.binding.subspan %lat_b[%c0] : !stream.binding -> {{lm}}
      %pe = stream.binding.subspan %pe_b[%c0] : !stream.binding -> {{pm}}
      %rows = stream.binding.subspan %rows_b[%c0] : !stream.binding -> {{rm}}
      %rows_pe = stream.binding.subspan %rows_pe_b[%c0] : !stream.binding -> {{qm}}
      %wg = stream.dispatch.workgroup.id[0] : index
      %b = arith.divui %wg, %c_chunks : index
      %chunk = arith.remui %wg, %c_chunks : index
      %j_begin = arith.muli %chunk, %c_ch : index
      %j_end = arith.addi %j_begin, %c_ch : index
      scf.for %j = %j_begin to %j_end step %c1 {
        %s32 = memref.load %idx[%b, %c0, %j] : {{im}}
        %s = arith.index_cast %s32 : i32 to index
        scf.for %c = %c0 to %c_r step %c_w {
          %v = vector.load %lat[%b, %s, %c] : {{lm}}, {{vf}}
          vector.store %v, %rows[%b, %c0, %j, %c] : {{rm}}, {{vf}}
        }
        scf.for %c = %c0 to %c_p step %c_w {
          %v = vector.load %pe[%b, %s, %c] : {{pm}}, {{vf}}
          vector.store %v, %rows_pe[%b, %c0, %j, %c] : {{qm}}, {{vf}}
        }
      }
      return
    }
  }
}

util.func private @{{name}}(%idx: {{it}}, %latent: {{lt}}, %k_pe: {{pt}}) -> ({{rt}}, {{qt}}) {
  %rows, %rows_pe = flow.dispatch @{{fn}}_dispatch::@{{fn}}(%idx, %latent, %k_pe) : ({{it}}, {{lt}}, {{pt}}) -> ({{rt}}, {{qt}})
  util.return %rows, %rows_pe : {{rt}}, {{qt}}
}
