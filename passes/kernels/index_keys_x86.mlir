{#- The lightning indexer's order keys for one decode query on x86 (passes/sparse_attention.py says why):
      I[s]   = sum_h w[h] * ReLU(q[h] . k[s] * scale)
      key[s] = the int32 whose order is I[s]'s float order (-0 as +0); INT32_MIN for s > pos (invisible)
    Keys are taken NT at a time, heads HG at a time (NT * HG = width): the NT * HG dot products of a
    group run as `width` vector accumulators over d, whose lanes one shuffle tree sums into one
    vector (lane i: head i / NT, key i % NT) so no dot product pays for a horizontal sum of its own.
    A tile of keys wholly past pos is not computed: the work follows the depth, not the window.
    keys:     {{name}}(q [B, 1, HI, DI], w [B, 1, HI], k [B, S, DI] f32, pos [B, 1] i64) -> [B, 1, S] i32
    params:   name, B, S, HI, DI, width, NT, HG, CH (keys a workgroup, the last one clamped to S), scale (f32 hex), tree (the shuffle
              masks, one (lo, hi) pair of index lists a stage), folds (the lane shifts summing over heads) -#}
{% import "lane_sums.mlir" as lanes %}
{% set fn = name ~ "_keys" %}
{% set chunks = (S + CH - 1) // CH %}
{% set qt, wt, kt, pt, ot = "tensor<%dx1x%dx%dxf32>" % (B, HI, DI), "tensor<%dx1x%dxf32>" % (B, HI), "tensor<%dx%dx%dxf32>" % (B, S, DI), "tensor<%dx1xi64>" % B, "tensor<%dx1x%dxi32>" % (B, S) %}
{% set qm, wm, km, pm, om = "memref<%dx1x%dx%dxf32>" % (B, HI, DI), "memref<%dx1x%dxf32>" % (B, HI), "memref<%dx%dx%dxf32>" % (B, S, DI), "memref<%dx1xi64>" % B, "memref<%dx1x%dxi32>" % (B, S) %}
{% set vf, tf, ti, tl = "vector<%dxf32>" % width, "vector<%dxf32>" % NT, "vector<%dxi32>" % NT, "vector<%dxi64>" % NT %}
{% set accs = range(width) | list %}
{% set vtypes = [vf] * width %}
stream.executable private @{{fn}}_dispatch {
  stream.executable.export public @{{fn}} workgroups() -> (index, index, index) {
    %x = arith.constant {{B * chunks}} : index
    %c1 = arith.constant 1 : index
    stream.return %x, %c1, %c1 : index, index, index
  }
  builtin.module {
    func.func @{{fn}}(%q_b: !stream.binding, %w_b: !stream.binding, %k_b: !stream.binding, %pos_b: !stream.binding,
                      %out_b: !stream.binding) {
      %c0 = arith.constant 0 : index
      %c_chunks = arith.constant {{chunks}} : index
      %c_ch = arith.constant {{CH}} : index
      %c_s = arith.constant {{S}} : index
      %c_nt = arith.constant {{NT}} : index
      %c_hg = arith.constant {{HG}} : index
      %c_hi = arith.constant {{HI}} : index
      %c_di = arith.constant {{DI}} : index
      %c_w = arith.constant {{width}} : index
{% for i in range([NT, HG] | max) %}
      %c{{i}}_i = arith.constant {{i}} : index
{% endfor %}
      %zero = arith.constant dense<0.0> : {{vf}}
      %scale = arith.constant dense<{{scale}}> : {{vf}}
      %int_min = arith.constant dense<-2147483648> : {{ti}}
      %zero_i = arith.constant dense<0> : {{ti}}
      %magnitude = arith.constant dense<2147483647> : {{ti}}
      %lane = arith.constant dense<[{{ range(NT) | join(", ") }}]> : {{tl}}
      %q = stream.binding.subspan %q_b[%c0] : !stream.binding -> {{qm}}
      %w = stream.binding.subspan %w_b[%c0] : !stream.binding -> {{wm}}
      %k = stream.binding.subspan %k_b[%c0] : !stream.binding -> {{km}}
      %pos = stream.binding.subspan %pos_b[%c0] : !stream.binding -> {{pm}}
      %out = stream.binding.subspan %out_b[%c0] : !stream.binding -> {{om}}
      %wg = stream.dispatch.workgroup.id[0] : index
      %b = arith.divui %wg, %c_chunks : index
      %chunk = arith.remui %wg, %c_chunks : index
      %s_begin = arith.muli %chunk, %c_ch : index
      %s_full = arith.addi %s_begin, %c_ch : index
      %s_end = arith.minui %s_full, %c_s : index
      %p = memref.load %pos[%b, %c0] : {{pm}}
      %p_v = vector.broadcast %p : i64 to {{tl}}
      scf.for %s = %s_begin to %s_end step %c_nt {
        %s64 = arith.index_cast %s : index to i64
        %past = arith.cmpi sgt, %s64, %p : i64
        scf.if %past {
          vector.store %int_min, %out[%b, %c0, %s] : {{om}}, {{ti}}
        } else {
{% for t in range(NT) %}
          %s{{t}} = arith.addi %s, %c{{t}}_i : index
{% endfor %}
          %score = scf.for %g = %c0 to %c_hi step %c_hg iter_args(%sa = %zero) -> ({{vf}}) {
{% for h in range(HG) %}
            %h{{h}} = arith.addi %g, %c{{h}}_i : index
{% endfor %}
            %dot:{{width}} = scf.for %d = %c0 to %c_di step %c_w iter_args({% for i in accs %}%a{{i}} = %zero{{ ", " if not loop.last }}{% endfor %}) -> ({{ vtypes | join(", ") }}) {
{% for t in range(NT) %}
              %k{{t}} = vector.load %k[%b, %s{{t}}, %d] : {{km}}, {{vf}}
{% endfor %}
{% for h in range(HG) %}
              %q{{h}} = vector.load %q[%b, %c0, %h{{h}}, %d] : {{qm}}, {{vf}}
{% for t in range(NT) %}
              %n{{h * NT + t}} = math.fma %q{{h}}, %k{{t}}, %a{{h * NT + t}} : {{vf}}
{% endfor %}
{% endfor %}
              scf.yield {% for i in accs %}%n{{i}}{{ ", " if not loop.last }}{% endfor %} : {{ vtypes | join(", ") }}
            }
{{ lanes.lane_sums("dot", "t", width, tree, vf) | indent(12, true) }}
            %w_g = vector.load %w[%b, %c0, %g] : {{wm}}, vector<{{HG}}xf32>
            %w_v = vector.shuffle %w_g, %w_g [{% for i in accs %}{{ i // NT }}{{ ", " if not loop.last }}{% endfor %}] : vector<{{HG}}xf32>, vector<{{HG}}xf32>
            %x = arith.mulf {{ lanes.lane_sums_result("t", tree) }}, %scale : {{vf}}
            %relu = arith.maximumf %x, %zero : {{vf}}
            %m = arith.mulf %w_v, %relu : {{vf}}
            %sa2 = arith.addf %sa, %m : {{vf}}
            scf.yield %sa2 : {{vf}}
          }
{# lanes h * NT + t: sum over h by halving, the NT key scores end in lanes 0..NT-1 #}
{% set last = namespace(v="%score") %}
{% for shift in folds %}
          %fold{{loop.index0}}_sh = vector.shuffle {{ last.v }}, {{ last.v }} [{% for i in accs %}{{ (i + shift) % width }}{{ ", " if not loop.last }}{% endfor %}] : {{vf}}, {{vf}}
          %fold{{loop.index0}} = arith.addf {{ last.v }}, %fold{{loop.index0}}_sh : {{vf}}
{% set last.v = "%%fold%d" % loop.index0 %}
{% endfor %}
          %scores = vector.shuffle {{ last.v }}, {{ last.v }} [{{ range(NT) | join(", ") }}] : {{vf}}, {{vf}}
          %bits = arith.bitcast %scores : {{tf}} to {{ti}}
          %neg = arith.cmpi slt, %bits, %zero_i : {{ti}}
          %flip = arith.xori %bits, %magnitude : {{ti}}
          %ordered = arith.select %neg, %flip, %bits : vector<{{NT}}xi1>, {{ti}}
          %negzero = arith.cmpi eq, %bits, %int_min : {{ti}}
          %key0 = arith.select %negzero, %zero_i, %ordered : vector<{{NT}}xi1>, {{ti}}
          %s_v = vector.broadcast %s64 : i64 to {{tl}}
          %slot = arith.addi %s_v, %lane : {{tl}}
          %visible = arith.cmpi sle, %slot, %p_v : {{tl}}
          %key = arith.select %visible, %key0, %int_min : vector<{{NT}}xi1>, {{ti}}
          vector.store %key, %out[%b, %c0, %s] : {{om}}, {{ti}}
        }
      }
      return
    }
  }
}

util.func private @{{name}}(%q: {{qt}}, %w: {{wt}}, %k: {{kt}}, %pos: {{pt}}) -> {{ot}} {
  %keys = flow.dispatch @{{fn}}_dispatch::@{{fn}}(%q, %w, %k, %pos) : ({{qt}}, {{wt}}, {{kt}}, {{pt}}) -> {{ot}}
  util.return %keys : {{ot}}
}
