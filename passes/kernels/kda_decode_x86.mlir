{#- KDA's decode step on x86 (passes/kda.py says why): per head, over the columns of S in chunks of C vectors
    of `width` floats held in registers,
      pass 1, rows d = 0..dk-1:  p += (S[d] * decay[d]) * k[d]            (predicted = S1^T k)
              delta = (v - p) * beta
      pass 2, rows d = 0..dk-1:  S'[d] = k[d] * delta + S[d] * decay[d];  o += S'[d] * q[d]
    S is read twice (the second time from L2: a head's chunk is dk x C*width floats) and written once.
    step:     {{name}}_step(q, k [B, H, dk], v [B, H, dv], decay [B, H, dk], beta [B, H], S [B, H, dk, dv])
                -> (o [B, H, dv], S' [B, H, dk, dv]), all f32
    params:   name, B, H, dk, dv, C, width -#}
{% set step = name ~ "_step" %}
{% set qt, vt, bt, st = "tensor<%dx%dx%dxf32>" % (B, H, dk), "tensor<%dx%dx%dxf32>" % (B, H, dv), "tensor<%dx%dxf32>" % (B, H), "tensor<%dx%dx%dx%dxf32>" % (B, H, dk, dv) %}
{% set qm, vm, bm, sm = "memref<%dx%dx%dxf32>" % (B, H, dk), "memref<%dx%dx%dxf32>" % (B, H, dv), "memref<%dx%dxf32>" % (B, H), "memref<%dx%dx%dx%dxf32>" % (B, H, dk, dv) %}
{% set vf = "vector<%dxf32>" % width %}
{% set accs = range(C) | list %}
stream.executable private @{{step}}_dispatch {
  stream.executable.export public @{{step}} workgroups() -> (index, index, index) {
    %x = arith.constant {{B * H}} : index
    %c1 = arith.constant 1 : index
    stream.return %x, %c1, %c1 : index, index, index
  }
  builtin.module {
    func.func @{{step}}(%q_b: !stream.binding, %k_b: !stream.binding, %v_b: !stream.binding, %d_b: !stream.binding,
                        %beta_b: !stream.binding, %s_b: !stream.binding, %o_b: !stream.binding, %s2_b: !stream.binding) {
        %c0 = arith.constant 0 : index
        %c1 = arith.constant 1 : index
        %c_h = arith.constant {{H}} : index
        %c_dk = arith.constant {{dk}} : index
        %c_dv = arith.constant {{dv}} : index
        %c_chunk = arith.constant {{C * width}} : index
{% for c in accs %}
        %off{{c}} = arith.constant {{c * width}} : index
{% endfor %}
        %zero = arith.constant dense<0.0> : {{vf}}
        %q = stream.binding.subspan %q_b[%c0] : !stream.binding -> {{qm}}
        %k = stream.binding.subspan %k_b[%c0] : !stream.binding -> {{qm}}
        %v = stream.binding.subspan %v_b[%c0] : !stream.binding -> {{vm}}
        %dec = stream.binding.subspan %d_b[%c0] : !stream.binding -> {{qm}}
        %beta = stream.binding.subspan %beta_b[%c0] : !stream.binding -> {{bm}}
        %s = stream.binding.subspan %s_b[%c0] : !stream.binding -> {{sm}}
        %o = stream.binding.subspan %o_b[%c0] : !stream.binding -> {{vm}}
        %s2 = stream.binding.subspan %s2_b[%c0] : !stream.binding -> {{sm}}
        %wg = stream.dispatch.workgroup.id[0] : index
        %b = arith.divui %wg, %c_h : index
        %h = arith.remui %wg, %c_h : index
        %beta_s = memref.load %beta[%b, %h] : {{bm}}
        %beta_v = vector.broadcast %beta_s : f32 to {{vf}}
        scf.for %col = %c0 to %c_dv step %c_chunk {
{% for c in accs %}
          %col{{c}} = arith.addi %col, %off{{c}} : index
{% endfor %}
          %p:{{C}} = scf.for %d = %c0 to %c_dk step %c1 iter_args({% for c in accs %}%pa{{c}} = %zero{{ ", " if not loop.last }}{% endfor %}) -> ({% for c in accs %}{{vf}}{{ ", " if not loop.last }}{% endfor %}) {
            %dd = memref.load %dec[%b, %h, %d] : {{qm}}
            %kd = memref.load %k[%b, %h, %d] : {{qm}}
            %dd_v = vector.broadcast %dd : f32 to {{vf}}
            %kd_v = vector.broadcast %kd : f32 to {{vf}}
{% for c in accs %}
            %row{{c}} = vector.load %s[%b, %h, %d, %col{{c}}] : {{sm}}, {{vf}}
            %s1_{{c}} = arith.mulf %row{{c}}, %dd_v : {{vf}}
            %pn{{c}} = math.fma %s1_{{c}}, %kd_v, %pa{{c}} : {{vf}}
{% endfor %}
            scf.yield {% for c in accs %}%pn{{c}}{{ ", " if not loop.last }}{% endfor %} : {% for c in accs %}{{vf}}{{ ", " if not loop.last }}{% endfor %}

          }
{% for c in accs %}
          %vv{{c}} = vector.load %v[%b, %h, %col{{c}}] : {{vm}}, {{vf}}
          %err{{c}} = arith.subf %vv{{c}}, %p#{{c}} : {{vf}}
          %delta{{c}} = arith.mulf %err{{c}}, %beta_v : {{vf}}
{% endfor %}
          %out:{{C}} = scf.for %d = %c0 to %c_dk step %c1 iter_args({% for c in accs %}%oa{{c}} = %zero{{ ", " if not loop.last }}{% endfor %}) -> ({% for c in accs %}{{vf}}{{ ", " if not loop.last }}{% endfor %}) {
            %dd = memref.load %dec[%b, %h, %d] : {{qm}}
            %kd = memref.load %k[%b, %h, %d] : {{qm}}
            %qd = memref.load %q[%b, %h, %d] : {{qm}}
            %dd_v = vector.broadcast %dd : f32 to {{vf}}
            %kd_v = vector.broadcast %kd : f32 to {{vf}}
            %qd_v = vector.broadcast %qd : f32 to {{vf}}
{% for c in accs %}
            %row{{c}} = vector.load %s[%b, %h, %d, %col{{c}}] : {{sm}}, {{vf}}
            %s1_{{c}} = arith.mulf %row{{c}}, %dd_v : {{vf}}
            %s2_{{c}} = math.fma %kd_v, %delta{{c}}, %s1_{{c}} : {{vf}}
            vector.store %s2_{{c}}, %s2[%b, %h, %d, %col{{c}}] : {{sm}}, {{vf}}
            %on{{c}} = math.fma %s2_{{c}}, %qd_v, %oa{{c}} : {{vf}}
{% endfor %}
            scf.yield {% for c in accs %}%on{{c}}{{ ", " if not loop.last }}{% endfor %} : {% for c in accs %}{{vf}}{{ ", " if not loop.last }}{% endfor %}

          }
{% for c in accs %}
          vector.store %out#{{c}}, %o[%b, %h, %col{{c}}] : {{vm}}, {{vf}}
{% endfor %}
        }
        return
    }
  }
}

util.func private @{{name}}(%q: {{qt}}, %k: {{qt}}, %v: {{vt}}, %decay: {{qt}}, %beta: {{bt}}, %state: {{st}}) -> ({{vt}}, {{st}}) {
  %o, %s = flow.dispatch @{{step}}_dispatch::@{{step}}(%q, %k, %v, %decay, %beta, %state) : ({{qt}}, {{qt}}, {{vt}}, {{qt}}, {{bt}}, {{st}}) -> ({{vt}}, {{st}})
  util.return %o, %s : {{vt}}, {{st}}
}
