{#- A decode query's attention over its selected cache rows on x86 (passes/sparse_attention.py steps 5-6 in
    one dispatch): the rows are read from the caches where they lie, never gathered into a buffer.
      scores[h, j] = (ql[h] . latent[idx[j]] + qp[h] . k_pe[idx[j]]) * scale,  -inf for j >= kept
      probs[h, j]  = softmax over j (max, exp of the difference, sum, divide: linalg.softmax's steps)
      out[h, c]    = sum_{j < kept} probs[h, j] * latent[idx[j], c]   (probs past kept are exactly 0)
    A workgroup takes HW heads of one sequence. Scores: NT rows by HG heads (NT * HG = width) as `width`
    vector accumulators over c, one shuffle tree summing their lanes (lane i: head i / NT, row i % NT), as
    kernels/index_keys_x86.mlir. Output: HB heads by CW vectors of c a pass over the kept rows.
    attend:   {{name}}(ql [B, 1, H, R], qp [B, 1, H, P], idx [B, 1, K] i32, kept [B, 1] i32, latent [B, S, R],
                       k_pe [B, S, P]) -> (out [B, 1, H, R], probs [B, 1, H, K])
    params:   name, B, S, K, H, R, P, width, NT, HG, HW, HB, CW, scale (f32 hex), tree (the shuffle masks) -#}
{% import "lane_sums.mlir" as lanes %}
{% set fn = name ~ "_attend" %}
{% set groups = H // HW %}
{% set qlt, qpt, it, ct = "tensor<%dx1x%dx%dxf32>" % (B, H, R), "tensor<%dx1x%dx%dxf32>" % (B, H, P), "tensor<%dx1x%dxi32>" % (B, K), "tensor<%dx1xi32>" % B %}
{% set lt, pt, pbt = "tensor<%dx%dx%dxf32>" % (B, S, R), "tensor<%dx%dx%dxf32>" % (B, S, P), "tensor<%dx1x%dx%dxf32>" % (B, H, K) %}
{% set qlm, qpm, im, cm = qlt | replace("tensor", "memref"), qpt | replace("tensor", "memref"), it | replace("tensor", "memref"), ct | replace("tensor", "memref") %}
{% set lm, pm, pbm = lt | replace("tensor", "memref"), pt | replace("tensor", "memref"), pbt | replace("tensor", "memref") %}
{% set vf, tf = "vector<%dxf32>" % width, "vector<%dxf32>" % NT %}
{% set accs = range(width) | list %}
{% set vtypes = [vf] * width %}
{% macro zero_init(i) %}%zero{% endmacro %}
{% macro latent_init(i) %}%dot_r#{{i}}{% endmacro %}
{# the NT x HG dot products over one cache (rows of `rows`, queries of `q`), `bound` columns, from `init` #}
{% macro dot_tile(result, rows, rows_m, q, q_m, bound, init) %}
          %{{result}}:{{width}} = scf.for %c = %c0 to {{bound}} step %c_w iter_args({% for i in accs %}%a{{i}} = {{ init(i) }}{{ ", " if not loop.last }}{% endfor %}) -> ({{ vtypes | join(", ") }}) {
{% for t in range(NT) %}
            %k{{t}} = vector.load {{rows}}[%b, %s{{t}}, %c] : {{rows_m}}, {{vf}}
{% endfor %}
{% for h in range(HG) %}
            %q{{h}} = vector.load {{q}}[%b, %c0, %h{{h}}, %c] : {{q_m}}, {{vf}}
{% for t in range(NT) %}
            %n{{h * NT + t}} = math.fma %q{{h}}, %k{{t}}, %a{{h * NT + t}} : {{vf}}
{% endfor %}
{% endfor %}
            scf.yield {% for i in accs %}%n{{i}}{{ ", " if not loop.last }}{% endfor %} : {{ vtypes | join(", ") }}
          }
{% endmacro %}
{% set outs = range(HB * CW) | list %}
{% set otypes = [vf] * (HB * CW) %}
stream.executable private @{{fn}}_dispatch {
  stream.executable.export public @{{fn}} workgroups() -> (index, index, index) {
    %x = arith.constant {{B * groups}} : index
    %c1 = arith.constant 1 : index
    stream.return %x, %c1, %c1 : index, index, index
  }
  builtin.module {
    func.func @{{fn}}(%ql_b: !stream.binding, %qp_b: !stream.binding, %idx_b: !stream.binding, %kept_b: !stream.binding,
                      %lat_b: !stream.binding, %pe_b: !stream.binding, %out_b: !stream.binding, %probs_b: !stream.binding) {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c_groups = arith.constant {{groups}} : index
      %c_hw = arith.constant {{HW}} : index
      %c_hg = arith.constant {{HG}} : index
      %c_hb = arith.constant {{HB}} : index
      %c_nt = arith.constant {{NT}} : index
      %c_k = arith.constant {{K}} : index
      %c_r = arith.constant {{R}} : index
      %c_p = arith.constant {{P}} : index
      %c_w = arith.constant {{width}} : index
      %c_cw = arith.constant {{CW * width}} : index
{% for i in range([NT, HG, HB] | max) %}
      %c{{i}}_i = arith.constant {{i}} : index
{% endfor %}
{% for w in range(CW) %}
      %cw{{w}} = arith.constant {{w * width}} : index
{% endfor %}
      %zero = arith.constant dense<0.0> : {{vf}}
      %scale = arith.constant dense<{{scale}}> : {{vf}}
      %neg_inf = arith.constant dense<0xFF800000> : {{vf}}
      %row_of_lane = arith.constant dense<[{% for i in accs %}{{ i % NT }}{{ ", " if not loop.last }}{% endfor %}]> : vector<{{width}}xi32>
      %ql = stream.binding.subspan %ql_b[%c0] : !stream.binding -> {{qlm}}
      %qp = stream.binding.subspan %qp_b[%c0] : !stream.binding -> {{qpm}}
      %idx = stream.binding.subspan %idx_b[%c0] : !stream.binding -> {{im}}
      %kept = stream.binding.subspan %kept_b[%c0] : !stream.binding -> {{cm}}
      %lat = stream.binding.subspan %lat_b[%c0] : !stream.binding -> {{lm}}
      %pe = stream.binding.subspan %pe_b[%c0] : !stream.binding -> {{pm}}
      %out = stream.binding.subspan %out_b[%c0] : !stream.binding -> {{qlm}}
      %probs = stream.binding.subspan %probs_b[%c0] : !stream.binding -> {{pbm}}
      %wg = stream.dispatch.workgroup.id[0] : index
      %b = arith.divui %wg, %c_groups : index
      %group = arith.remui %wg, %c_groups : index
      %head0 = arith.muli %group, %c_hw : index
      %n_kept = memref.load %kept[%b, %c0] : {{cm}}
      %n_kept_idx = arith.index_cast %n_kept : i32 to index
      %n_kept_v = vector.broadcast %n_kept : i32 to vector<{{width}}xi32>
      // scores: NT rows a step, HG heads at a time
      scf.for %j = %c0 to %c_k step %c_nt {
{% for t in range(NT) %}
        %jt{{t}} = arith.addi %j, %c{{t}}_i : index
        %s{{t}}_i32 = memref.load %idx[%b, %c0, %jt{{t}}] : {{im}}
        %s{{t}} = arith.index_cast %s{{t}}_i32 : i32 to index
{% endfor %}
        %j_i32 = arith.index_cast %j : index to i32
        %j_v = vector.broadcast %j_i32 : i32 to vector<{{width}}xi32>
        %row = arith.addi %j_v, %row_of_lane : vector<{{width}}xi32>
        %counts = arith.cmpi slt, %row, %n_kept_v : vector<{{width}}xi32>
        scf.for %g = %c0 to %c_hw step %c_hg {
          %hg = arith.addi %head0, %g : index
{% for h in range(HG) %}
          %h{{h}} = arith.addi %hg, %c{{h}}_i : index
{% endfor %}
{# one set of accumulators over both caches: the latent part, then the rope part #}
{{ dot_tile("dot_r", "%lat", lm, "%ql", qlm, "%c_r", zero_init) -}}
{{ dot_tile("dot", "%pe", pm, "%qp", qpm, "%c_p", latent_init) -}}
{{ lanes.lane_sums("dot", "t", width, tree, vf) | indent(10, true) }}
          %scaled = arith.mulf {{ lanes.lane_sums_result("t", tree) }}, %scale : {{vf}}
          %score = arith.select %counts, %scaled, %neg_inf : vector<{{width}}xi1>, {{vf}}
{% for h in range(HG) %}
          %score{{h}} = vector.shuffle %score, %score [{{ range(h * NT, h * NT + NT) | join(", ") }}] : {{vf}}, {{vf}}
          vector.store %score{{h}}, %probs[%b, %c0, %h{{h}}, %j] : {{pbm}}, {{tf}}
{% endfor %}
        }
      }
      // softmax over the K rows of each of the workgroup's heads
      scf.for %hh = %c0 to %c_hw step %c1 {
        %h = arith.addi %head0, %hh : index
        %max_v = scf.for %j = %c0 to %c_k step %c_w iter_args(%m = %neg_inf) -> ({{vf}}) {
          %x = vector.load %probs[%b, %c0, %h, %j] : {{pbm}}, {{vf}}
          %m2 = arith.maximumf %m, %x : {{vf}}
          scf.yield %m2 : {{vf}}
        }
        %max = vector.reduction <maximumf>, %max_v : {{vf}} into f32
        %max_b = vector.broadcast %max : f32 to {{vf}}
        %sum_v = scf.for %j = %c0 to %c_k step %c_w iter_args(%acc = %zero) -> ({{vf}}) {
          %x = vector.load %probs[%b, %c0, %h, %j] : {{pbm}}, {{vf}}
          %d = arith.subf %x, %max_b : {{vf}}
          %e = math.exp %d : {{vf}}
          vector.store %e, %probs[%b, %c0, %h, %j] : {{pbm}}, {{vf}}
          %acc2 = arith.addf %acc, %e : {{vf}}
          scf.yield %acc2 : {{vf}}
        }
        %sum = vector.reduction <add>, %sum_v : {{vf}} into f32
        %sum_b = vector.broadcast %sum : f32 to {{vf}}
        scf.for %j = %c0 to %c_k step %c_w {
          %e = vector.load %probs[%b, %c0, %h, %j] : {{pbm}}, {{vf}}
          %p = arith.divf %e, %sum_b : {{vf}}
          vector.store %p, %probs[%b, %c0, %h, %j] : {{pbm}}, {{vf}}
        }
      }
      // out: HB heads by CW vectors of c a pass over the kept rows
      scf.for %hb = %c0 to %c_hw step %c_hb {
        %h_base = arith.addi %head0, %hb : index
{% for h in range(HB) %}
        %hb{{h}} = arith.addi %h_base, %c{{h}}_i : index
{% endfor %}
        scf.for %c = %c0 to %c_r step %c_cw {
{% for w in range(CW) %}
          %cc{{w}} = arith.addi %c, %cw{{w}} : index
{% endfor %}
          %o:{{HB * CW}} = scf.for %j = %c0 to %n_kept_idx step %c1 iter_args({% for i in outs %}%a{{i}} = %zero{{ ", " if not loop.last }}{% endfor %}) -> ({{ otypes | join(", ") }}) {
            %s_i32 = memref.load %idx[%b, %c0, %j] : {{im}}
            %s = arith.index_cast %s_i32 : i32 to index
{% for w in range(CW) %}
            %v{{w}} = vector.load %lat[%b, %s, %cc{{w}}] : {{lm}}, {{vf}}
{% endfor %}
{% for h in range(HB) %}
            %p{{h}} = memref.load %probs[%b, %c0, %hb{{h}}, %j] : {{pbm}}
            %pv{{h}} = vector.broadcast %p{{h}} : f32 to {{vf}}
{% for w in range(CW) %}
            %n{{h * CW + w}} = math.fma %pv{{h}}, %v{{w}}, %a{{h * CW + w}} : {{vf}}
{% endfor %}
{% endfor %}
            scf.yield {% for i in outs %}%n{{i}}{{ ", " if not loop.last }}{% endfor %} : {{ otypes | join(", ") }}
          }
{% for h in range(HB) %}
{% for w in range(CW) %}
          vector.store %o#{{h * CW + w}}, %out[%b, %c0, %hb{{h}}, %cc{{w}}] : {{qlm}}, {{vf}}
{% endfor %}
{% endfor %}
        }
      }
      return
    }
  }
}

util.func private @{{name}}(%ql: {{qlt}}, %qp: {{qpt}}, %idx: {{it}}, %kept: {{ct}}, %latent: {{lt}}, %k_pe: {{pt}}) -> {{qlt}} {
  %out, %probs = flow.dispatch @{{fn}}_dispatch::@{{fn}}(%ql, %qp, %idx, %kept, %latent, %k_pe) : ({{qlt}}, {{qpt}}, {{it}}, {{ct}}, {{lt}}, {{pt}}) -> ({{qlt}}, {{pbt}})
  util.return %out : {{qlt}}
}
