{#- The selection of one decode query on x86 (passes/sparse_attention.py steps 3-4 in one dispatch, one
    workgroup a sequence): the linalg form is some 14 small dispatches a layer (8 radix rounds, two scans,
    a scatter), each a round trip through IREE's task system; here one thread does them in one pass each.
      kth   = the k-th largest key: one digit a round, counting the keys at or above `candidates` values,
              exactly as frontend/selection.py `kth_largest_key` (any exact method gives the same value)
      keep  = key > kth, plus the earliest visible ties (key == kth, s <= pos) until k are kept
      idx   = the kept slots in increasing order, then 0 (the spare places the attention masks)
    Keys past pos are INT32_MIN (step 2), so only the vectors up to the one holding pos are read; the
    INT32_MIN tail beyond them counts at the candidate INT32_MIN only.
    select:   {{name}}(key [B, 1, S] i32, pos [B, 1] i64) -> (idx [B, 1, K] i32, kept [B, 1] i32)
    params:   name, B, S, K, width, candidates, rounds (shift, offset: passes/sparse_attention.py `radix_rounds`) -#}
{% set fn = name ~ "_select" %}
{% set kt, pt, it, ct = "tensor<%dx1x%dxi32>" % (B, S), "tensor<%dx1xi64>" % B, "tensor<%dx1x%dxi32>" % (B, K), "tensor<%dx1xi32>" % B %}
{% set km, pm, im, cm = kt | replace("tensor", "memref"), pt | replace("tensor", "memref"), it | replace("tensor", "memref"), ct | replace("tensor", "memref") %}
{% set vi, vb = "vector<%dxi32>" % width, "vector<%dxi1>" % width %}
{% set cands = range(candidates) | list %}
stream.executable private @{{fn}}_dispatch {
  stream.executable.export public @{{fn}} workgroups() -> (index, index, index) {
    %x = arith.constant {{B}} : index
    %c1 = arith.constant 1 : index
    stream.return %x, %c1, %c1 : index, index, index
  }
  builtin.module {
    func.func @{{fn}}(%key_b: !stream.binding, %pos_b: !stream.binding, %idx_b: !stream.binding, %kept_b: !stream.binding) {
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c_w = arith.constant {{width}} : index
      %c_w1 = arith.constant {{width - 1}} : index
      %c_s = arith.constant {{S}} : index
      %c_k = arith.constant {{K}} : index
      %k_i32 = arith.constant {{K}} : i32
      %zero = arith.constant 0 : i32
      %one = arith.constant 1 : i32
      %int_min = arith.constant -2147483648 : i32
      %zero_v = arith.constant dense<0> : {{vi}}
      %key = stream.binding.subspan %key_b[%c0] : !stream.binding -> {{km}}
      %pos = stream.binding.subspan %pos_b[%c0] : !stream.binding -> {{pm}}
      %idx = stream.binding.subspan %idx_b[%c0] : !stream.binding -> {{im}}
      %kept = stream.binding.subspan %kept_b[%c0] : !stream.binding -> {{cm}}
      %b = stream.dispatch.workgroup.id[0] : index
      %p = memref.load %pos[%b, %c0] : {{pm}}
      %p_idx = arith.index_cast %p : i64 to index
      %visible = arith.addi %p_idx, %c1 : index
      %visible_s = arith.minui %visible, %c_s : index
      %round_up = arith.addi %visible_s, %c_w1 : index
      %vectors = arith.divui %round_up, %c_w : index
      %s_end = arith.muli %vectors, %c_w : index
      %tail_idx = arith.subi %c_s, %s_end : index
      %tail = arith.index_cast %tail_idx : index to i32
      %thr_r0 = arith.constant 0 : i32
{% for shift, offset in rounds %}
{% set r = loop.index0 %}
      // round {{r}}: the candidates thr + (c - {{offset}}) * 2^{{shift}}, c < {{candidates}}
      %step_r{{r}} = arith.constant {{2 ** shift}} : i32
{% for c in cands %}
      %d{{c}}_r{{r}} = arith.constant {{(c - offset) * 2 ** shift}} : i32
      %cand{{c}}_r{{r}} = arith.addi %thr_r{{r}}, %d{{c}}_r{{r}} : i32
      %cv{{c}}_r{{r}} = vector.broadcast %cand{{c}}_r{{r}} : i32 to {{vi}}
{% endfor %}
      %cnt_r{{r}}:{{candidates}} = scf.for %s = %c0 to %s_end step %c_w iter_args({% for c in cands %}%a{{c}} = %zero_v{{ ", " if not loop.last }}{% endfor %}) -> ({{ ([vi] * candidates) | join(", ") }}) {
        %kv = vector.load %key[%b, %c0, %s] : {{km}}, {{vi}}
{% for c in cands %}
        %ge{{c}} = arith.cmpi sge, %kv, %cv{{c}}_r{{r}} : {{vi}}
        %one{{c}} = arith.extui %ge{{c}} : {{vb}} to {{vi}}
        %n{{c}} = arith.addi %a{{c}}, %one{{c}} : {{vi}}
{% endfor %}
        scf.yield {% for c in cands %}%n{{c}}{{ ", " if not loop.last }}{% endfor %} : {{ ([vi] * candidates) | join(", ") }}
      }
{% for c in cands %}
      %sum{{c}}_r{{r}} = vector.reduction <add>, %cnt_r{{r}}#{{c}} : {{vi}} into i32
      %at_min{{c}}_r{{r}} = arith.cmpi eq, %cand{{c}}_r{{r}}, %int_min : i32
      %tail{{c}}_r{{r}} = arith.select %at_min{{c}}_r{{r}}, %tail, %zero : i32
      %total{{c}}_r{{r}} = arith.addi %sum{{c}}_r{{r}}, %tail{{c}}_r{{r}} : i32
      %holds{{c}}_r{{r}} = arith.cmpi sge, %total{{c}}_r{{r}}, %k_i32 : i32
      %h{{c}}_r{{r}} = arith.extui %holds{{c}}_r{{r}} : i1 to i32
{% if c == 0 %}
      %digits0_r{{r}} = arith.addi %h0_r{{r}}, %zero : i32
{% else %}
      %digits{{c}}_r{{r}} = arith.addi %digits{{c - 1}}_r{{r}}, %h{{c}}_r{{r}} : i32
{% endif %}
{% endfor %}
      // thr += (digit - offset) * step, digit = the candidates holding k keys, less one
      %offset_r{{r}} = arith.constant {{offset + 1}} : i32
      %signed_r{{r}} = arith.subi %digits{{candidates - 1}}_r{{r}}, %offset_r{{r}} : i32
      %delta_r{{r}} = arith.muli %signed_r{{r}}, %step_r{{r}} : i32
      %thr_r{{r + 1}} = arith.addi %thr_r{{r}}, %delta_r{{r}} : i32
{% endfor %}
{% set kth = "%%thr_r%d" % (rounds | length) %}
      %kth_v = vector.broadcast {{kth}} : i32 to {{vi}}
      // keys above kth (all visible: a key past pos is INT32_MIN, never above)
      %above_v = scf.for %s = %c0 to %s_end step %c_w iter_args(%a = %zero_v) -> ({{vi}}) {
        %kv = vector.load %key[%b, %c0, %s] : {{km}}, {{vi}}
        %gt = arith.cmpi sgt, %kv, %kth_v : {{vi}}
        %gt_i = arith.extui %gt : {{vb}} to {{vi}}
        %a2 = arith.addi %a, %gt_i : {{vi}}
        scf.yield %a2 : {{vi}}
      }
      %above = vector.reduction <add>, %above_v : {{vi}} into i32
      %room = arith.subi %k_i32, %above : i32
      // the kept slots in order: a vector with none kept is skipped whole, the others slot by slot
      %count:2 = scf.for %s = %c0 to %s_end step %c_w iter_args(%n = %zero, %ties = %zero) -> (i32, i32) {
        %kv = vector.load %key[%b, %c0, %s] : {{km}}, {{vi}}
        %ge = arith.cmpi sge, %kv, %kth_v : {{vi}}
        %any = vector.reduction <or>, %ge : {{vb}} into i1
        %next:2 = scf.if %any -> (i32, i32) {
          %in:2 = scf.for %l = %c0 to %c_w step %c1 iter_args(%n1 = %n, %t1 = %ties) -> (i32, i32) {
            %sl = arith.addi %s, %l : index
            %kk = memref.load %key[%b, %c0, %sl] : {{km}}
            %sl64 = arith.index_cast %sl : index to i64
            %vis = arith.cmpi sle, %sl64, %p : i64
            %is_gt = arith.cmpi sgt, %kk, {{kth}} : i32
            %is_eq = arith.cmpi eq, %kk, {{kth}} : i32
            %tie = arith.andi %is_eq, %vis : i1
            %has_room = arith.cmpi slt, %t1, %room : i32
            %tie_kept = arith.andi %tie, %has_room : i1
            %keep = arith.ori %is_gt, %tie_kept : i1
            %tie_i = arith.extui %tie : i1 to i32
            %t2 = arith.addi %t1, %tie_i : i32
            %n2 = scf.if %keep -> (i32) {
              %place = arith.index_cast %n1 : i32 to index
              %sl32 = arith.index_cast %sl : index to i32
              memref.store %sl32, %idx[%b, %c0, %place] : {{im}}
              %n3 = arith.addi %n1, %one : i32
              scf.yield %n3 : i32
            } else {
              scf.yield %n1 : i32
            }
            scf.yield %n2, %t2 : i32, i32
          }
          scf.yield %in#0, %in#1 : i32, i32
        } else {
          scf.yield %n, %ties : i32, i32
        }
        scf.yield %next#0, %next#1 : i32, i32
      }
      %first_spare = arith.index_cast %count#0 : i32 to index
      scf.for %j = %first_spare to %c_k step %c1 {
        memref.store %zero, %idx[%b, %c0, %j] : {{im}}
      }
      memref.store %count#0, %kept[%b, %c0] : {{cm}}
      return
    }
  }
}

util.func private @{{name}}(%key: {{kt}}, %pos: {{pt}}) -> ({{it}}, {{ct}}) {
  %idx, %kept = flow.dispatch @{{fn}}_dispatch::@{{fn}}(%key, %pos) : ({{kt}}, {{pt}}) -> ({{it}}, {{ct}})
  util.return %idx, %kept : {{it}}, {{ct}}
}
