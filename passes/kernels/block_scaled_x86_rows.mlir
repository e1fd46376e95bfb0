{#- The x86 rows of a block-scaled weight (passes/weights.py `x86_rows_function` says why): y[r, o] =
    sum_k w(e, o, k) x[r, k], row r through expert e = experts[r] (an id outside 0..E-1 reads the last
    expert) or expert 0 (a linear layer: R = E = 1), `width` codes a vector, `chains` sums over alternate
    vectors of K summed once at the end (in the dispatch). The weights are the reference's exactly
    (frontend/formats.py); only the f32 sum is reassociated:
      fp8_e4m3_b128  w = e4m3(code) * s[e, o / 128, k / 128]: each code decoded through f16 (its 7 low bits
                     placed in an f16 are the E4M3 value * 2^-8, vcvtph2ps widens them) times the block
                     scale * 2^8, one rounding (passes/block_scaled.py `cpu_function` says why that equals
                     v * s); the scale read once per 128 codes of K (K's last block may be partial)
      int4_g32       w = bf16_round((nibble - 8) * s[e, o, k / 32]): 8 nibbles a word (low first); one
                     group of 32 a step, its 16 possible weights (the products rounded to bf16, ties to
                     even, with integer ops: compressed-tensors multiplies in bf16) made once into a table,
                     each lane's weight looked up by its nibble (`lookup`): "avx512" (width 16) one vpermps
                     of the 16; "avx2" (width 8) vpermps of the low 8 and of the high 8 by the nibble's 3
                     low bits, blended by its bit 3 (shifted into the sign bit: vblendvps)
    Three forms:
      decode rows (run_sizes empty): workgroups R x O / o_tile, each one row's o_tile outputs, its
                  expert's codes streamed once (a decode step's k pairs, per-head rows, a linear layer)
      runs (run_sizes, e.g. [8, 4, 2, 1]): workgroups O / o_tile, each walking all R rows (row_runs.mlir) in
                  runs of rows with one expert, each code decoded once for the run (a prefill's pairs,
                  sorted by expert)
      batched (the batched unit, x [M, E, K]: expert e on rows m x E + e, no experts operand): workgroups
                  O / o_tile, each expert's M rows in runs of run_sizes[0] (per-head projections and linear
                  layers on a block; a linear layer is E = 1)
    rows:     {{name}}_rows(x [R, K] f32, codes, scales[, experts [R] i32]) -> [R, O]
    wrapper:  {{name}}(x [N, J, K] f32, codes, scales[, experts [N, J] i64]) -> [N, J, O], R = N x J; codes
              [E, O, K] i8 and scales [E, O/128, K/128] f32 (FP8), [E, O, K/8] i32 and [E, O, K/32] bf16 (INT4)
    params:   name, fmt, N, J, R, K, O, E, gathered, batched, o_tile (outputs a workgroup), width, chains,
              run_sizes, lookup -#}
{% import "row_runs.mlir" as runs %}
{% set rows = name ~ "_rows" %}
{% set fp8 = fmt == "fp8_e4m3_b128" %}
{% set group = 128 if fp8 else 32 %}
{% set KB, tail = (K + group - 1) // group, K % group %}
{% set xt, yt = "tensor<%dx%dxf32>" % (R, K), "tensor<%dx%dxf32>" % (R, O) %}
{% if fp8 %}
{% set OB = (O + 127) // 128 %}
{% set code_shape, code_el, scale_shape, scale_el = (E, O, K), "i8", (E, OB, KB), "f32" %}
{% else %}
{% set code_shape, code_el, scale_shape, scale_el = (E, O, K // 8), "i32", (E, O, KB), "bf16" %}
{% endif %}
{% set wt, st = "tensor<%s>" % ((code_shape | join("x")) ~ "x" ~ code_el), "tensor<%s>" % ((scale_shape | join("x")) ~ "x" ~ scale_el) %}
{% set w_mem, s_mem = wt | replace("tensor", "memref"), st | replace("tensor", "memref") %}
{% set vf, vh, vb, vm = "vector<%dxf32>" % width, "vector<%dxi16>" % width, "vector<%dxi8>" % width, "vector<%dxf16>" % width %}
{% set vi = "vector<%dxi32>" % width %}
{% set lane_words, lane_shifts, lane_bit3 = [], [], [] %}
{% for lane in range(width) %}{% set _ = lane_words.append(lane // 8) %}{% set _ = lane_shifts.append(4 * (lane % 8)) %}{% set _ = lane_bit3.append(28 - 4 * (lane % 8)) %}{% endfor %}
{% set sums = range(chains) | list %}
{#- `dst` = the f32 vector `src` rounded to bf16 (to nearest even) with integer ops, as an f32 vector -#}
{% macro bf16_round(src, dst) %}
              {{dst}}_b = arith.bitcast {{src}} : {{vf}} to {{vi}}
              {{dst}}_lsb0 = arith.shrui {{dst}}_b, %sixteen32 : {{vi}}
              {{dst}}_lsb = arith.andi {{dst}}_lsb0, %one32 : {{vi}}
              {{dst}}_bias = arith.addi {{dst}}_lsb, %round_bias : {{vi}}
              {{dst}}_sum = arith.addi {{dst}}_b, {{dst}}_bias : {{vi}}
              {{dst}}_rounded = arith.andi {{dst}}_sum, %high_half : {{vi}}
              {{dst}} = arith.bitcast {{dst}}_rounded : {{vi}} to {{vf}}
{% endmacro %}
{#- The sums of a run of `m` rows (row i: %r_i, its sums i*chains .. i*chains + chains-1) carried in `acc`
    (names) over `length` codes of K from %kbase, each code decoded once for the m rows and times the block
    scale vector %sv; defines %<out>#0 .. #m*chains-1 -#}
{% macro block_sums(out, length, acc, m) %}
{% set n = m * chains %}
            %{{out}}_len = arith.constant {{length}} : index
            %{{out}}:{{n}} = scf.for %kk = %c0 to %{{out}}_len step %c_chain iter_args({% for a in range(n) %}%s{{a}} = {{acc[a]}}{{ ", " if not loop.last }}{% endfor %}) -> ({{ ([vf] * n) | join(", ") }}) {
              %k = arith.addi %kbase, %kk : index
{% for c in sums %}
              %kc{{c}} = arith.addi %k, %c_off{{c}} : index
{% if fp8 %}
              %code{{c}} = vector.load %w[%e, %o, %kc{{c}}] : {{w_mem}}, {{vb}}
              %wide{{c}} = arith.extui %code{{c}} : {{vb}} to {{vh}}
              // S.EEEE.MMM -> f16 S.0EEEE.MMM0000000, the value * 2^-8, subnormals included (f16 subnormals
              // widen exactly: DAZ acts on f32 inputs): the code in the high byte, shifted right one with its
              // sign, the sign's copy (bit 14) cleared
              %high{{c}} = arith.shli %wide{{c}}, %eight : {{vh}}
              %signed{{c}} = arith.shrsi %high{{c}}, %one : {{vh}}
              %h0{{c}} = arith.andi %signed{{c}}, %not_bit14 : {{vh}}
              // S.1111.111 is E4M3FN's NaN (as the reference decodes it); selected as i16 (as f16, LLVM
              // moved the select past the widening: twice the lanes' work)
              %low{{c}} = arith.andi %high{{c}}, %low7 : {{vh}}
              %isnan{{c}} = arith.cmpi eq, %low{{c}}, %low7 : {{vh}}
              %h{{c}} = arith.select %isnan{{c}}, %nan16, %h0{{c}} : vector<{{width}}xi1>, {{vh}}
              %hf{{c}} = arith.bitcast %h{{c}} : {{vh}} to {{vm}}
              %v{{c}} = arith.extf %hf{{c}} : {{vm}} to {{vf}}
              %wv{{c}} = arith.mulf %v{{c}}, %sv : {{vf}}
{% else %}
              // width / 8 words of 8 nibbles (low first), each word to its 8 lanes, shifted by 4 x lane
              %wi{{c}} = arith.divui %kc{{c}}, %c_word : index
              %words{{c}} = vector.load %w[%e, %o, %wi{{c}}] : {{w_mem}}, vector<{{width // 8}}xi32>
              %spread{{c}} = vector.shuffle %words{{c}}, %words{{c}} [{{ lane_words | join(", ") }}] : vector<{{width // 8}}xi32>, vector<{{width // 8}}xi32>
              %shifted{{c}} = arith.shrui %spread{{c}}, %nibble_shift : {{vi}}
{% if lookup == "avx512" %}
              // vpermps: lane b <- the group's table[u_b] (it reads the index's 4 low bits: the nibble)
              %wv{{c}} = llvm.call_intrinsic "llvm.x86.avx512.permvar.sf.512"(%table, %shifted{{c}}) : ({{vf}}, {{vi}}) -> {{vf}}
{% elif lookup == "avx2" %}
              // vpermps reads the index's 3 low bits: entry u % 8 of the low and the high table; the
              // nibble's bit 3, shifted to the sign bit, picks the high one (vblendvps)
              %lo{{c}} = llvm.call_intrinsic "llvm.x86.avx2.permps"(%table_lo, %shifted{{c}}) : ({{vf}}, {{vi}}) -> {{vf}}
              %hi{{c}} = llvm.call_intrinsic "llvm.x86.avx2.permps"(%table_hi, %shifted{{c}}) : ({{vf}}, {{vi}}) -> {{vf}}
              %bit3{{c}} = arith.shli %spread{{c}}, %bit3_shift : {{vi}}
              %pick{{c}} = arith.bitcast %bit3{{c}} : {{vi}} to {{vf}}
              %wv{{c}} = llvm.call_intrinsic "llvm.x86.avx.blendv.ps.256"(%lo{{c}}, %hi{{c}}, %pick{{c}}) : ({{vf}}, {{vf}}, {{vf}}) -> {{vf}}
{% endif %}
{% endif %}
{% for i in range(m) %}
              %xv{{i}}_{{c}} = vector.load %x[%r_{{i}}, %kc{{c}}] : memref<{{R}}x{{K}}xf32>, {{vf}}
              %t{{i}}_{{c}} = math.fma %wv{{c}}, %xv{{i}}_{{c}}, %s{{i * chains + c}} : {{vf}}
{% endfor %}
{% endfor %}
{% set results = [] %}
{% for i in range(m) %}{% for c in sums %}{% set _ = results.append("%%t%d_%d" % (i, c)) %}{% endfor %}{% endfor %}
              scf.yield {{ results | join(", ") }} : {{ ([vf] * n) | join(", ") }}
            }
{% endmacro %}
{#- %sv: the scale of K block `kb` as a vector: FP8's of block (%e, %ob, kb) times 2^8, INT4's of group
    (%e, %o, kb) -#}
{% macro block_scale(kb) %}
{% if fp8 %}
            %s_one = memref.load %s[%e, %ob, {{kb}}] : {{s_mem}}
            %s_8 = arith.mulf %s_one, %c256 : f32
            %sv = vector.broadcast %s_8 : f32 to {{vf}}
{% else %}
            %s_bf = memref.load %s[%e, %o, {{kb}}] : {{s_mem}}
            %s_one = arith.extf %s_bf : bf16 to f32
            %sv = vector.broadcast %s_one : f32 to {{vf}}
{% if lookup == "avx512" %}
            // the group's 16 weights: bf16_round((u - 8) * scale) for u = 0..15, looked up by nibble
            %t_p = arith.mulf %q_iota, %sv : {{vf}}
{{ bf16_round("%t_p", "%table") }}
{% elif lookup == "avx2" %}
            // the group's 16 weights as two tables of 8: u = 0..7 (q = -8..-1) and u = 8..15 (q = 0..7)
            %t_lo_p = arith.mulf %q_lo, %sv : {{vf}}
{{ bf16_round("%t_lo_p", "%table_lo") }}
            %t_hi_p = arith.mulf %q_hi, %sv : {{vf}}
{{ bf16_round("%t_hi_p", "%table_hi") }}
{% endif %}
{% endif %}
{% endmacro %}
{#- Rows %r .. %r + m - 1 through expert %e, the workgroup's outputs %o_base .. + o_tile - 1: y[r + i, o] -#}
{% macro outputs(m) %}
{% set n = m * chains %}
{% for i in range(m) %}
{% if batched %}
          %m_{{i}} = arith.addi %m, %c{{i}} : index
          %me_{{i}} = arith.muli %m_{{i}}, %c_experts : index
          %r_{{i}} = arith.addi %me_{{i}}, %e : index
{% else %}
          %r_{{i}} = arith.addi %r, %c{{i}} : index
{% endif %}
{% endfor %}
        scf.for %oi = %c0 to %c_otile step %c1 {
          %o = arith.addi %o_base, %oi : index
{% if fp8 %}
          %ob = arith.divui %o, %c128 : index
{% endif %}
{% if K >= group %}
          %full:{{n}} = scf.for %kb = %c0 to %c_full_blocks step %c1 iter_args({% for a in range(n) %}%b{{a}} = %zero{{ ", " if not loop.last }}{% endfor %}) -> ({{ ([vf] * n) | join(", ") }}) {
            %kbase = arith.muli %kb, %c_group : index
{{ block_scale("%kb") }}
{% set carried = [] %}
{% for a in range(n) %}{% set _ = carried.append("%%b%d" % a) %}{% endfor %}
{{ block_sums("blk", group, carried, m) }}
            scf.yield {% for a in range(n) %}%blk#{{a}}{{ ", " if not loop.last }}{% endfor %} : {{ ([vf] * n) | join(", ") }}
          }
{% set acc = [] %}
{% for a in range(n) %}{% set _ = acc.append("%%full#%d" % a) %}{% endfor %}
{% else %}
{% set acc = ["%zero"] * n %}
{% endif %}
{% if tail %}
          %kbase = arith.constant {{K - tail}} : index
          %c_tail_block = arith.constant {{KB - 1}} : index
{{ block_scale("%c_tail_block") }}
{{ block_sums("tl", tail, acc, m) }}
{% set acc = [] %}
{% for a in range(n) %}{% set _ = acc.append("%%tl#%d" % a) %}{% endfor %}
{% endif %}
{% for i in range(m) %}
{% set last = namespace(v=acc[i * chains]) %}
{% for c in sums[1:] %}
          %chain_add{{i}}_{{c}} = arith.addf {{ last.v }}, {{acc[i * chains + c]}} : {{vf}}
{% set last.v = "%%chain_add%d_%d" % (i, c) %}
{% endfor %}
          %dot{{i}} = vector.reduction <add>, {{ last.v }} : {{vf}} into f32
          memref.store %dot{{i}}, %y[%r_{{i}}, %o] : memref<{{R}}x{{O}}xf32>
{% endfor %}
        }
{% endmacro %}
stream.executable private @{{rows}}_dispatch {
  stream.executable.export public @{{rows}} workgroups() -> (index, index, index) {
    %x = arith.constant {{(O // o_tile) * (1 if run_sizes else R)}} : index
    %c1 = arith.constant 1 : index
    stream.return %x, %c1, %c1 : index, index, index
  }
  builtin.module {
    func.func @{{rows}}(%x_b: !stream.binding, %w_b: !stream.binding, %s_b: !stream.binding, {{ "%ex_b: !stream.binding, " if gathered }}%y_b: !stream.binding) {
        %c0 = arith.constant 0 : index
        %c1 = arith.constant 1 : index
{% for i in range(2, (run_sizes or [1]) | max + 1) %}
        %c{{i}} = arith.constant {{i}} : index
{% endfor %}
        %c_group = arith.constant {{group}} : index
        %c_otile = arith.constant {{o_tile}} : index
        %c_tiles = arith.constant {{O // o_tile}} : index
        %c_full_blocks = arith.constant {{K // group}} : index
        %c_chain = arith.constant {{chains * width}} : index
{% for c in sums %}
        %c_off{{c}} = arith.constant {{c * width}} : index
{% endfor %}
        %zero = arith.constant dense<0.0> : {{vf}}
{% if fp8 %}
        %c128 = arith.constant 128 : index
        %c256 = arith.constant 256.0 : f32
        %one = arith.constant dense<1> : {{vh}}
        %eight = arith.constant dense<8> : {{vh}}
        %not_bit14 = arith.constant dense<-16385> : {{vh}}    // 0xBFFF
        %low7 = arith.constant dense<32512> : {{vh}}          // 0x7F00: the code's low 7 bits, in the high byte
        %nan16 = arith.constant dense<32256> : {{vh}}         // 0x7E00: an f16 NaN
{% else %}
        %c_word = arith.constant 8 : index
        %nibble_shift = arith.constant dense<[{{ lane_shifts | join(", ") }}]> : {{vi}}
        %sixteen32 = arith.constant dense<16> : {{vi}}
        %one32 = arith.constant dense<1> : {{vi}}
        %round_bias = arith.constant dense<32767> : {{vi}}
        %high_half = arith.constant dense<-65536> : {{vi}}
{% if lookup == "avx512" %}
        %q_iota = arith.constant dense<[-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]> : {{vf}}
{% elif lookup == "avx2" %}
        %q_lo = arith.constant dense<[-8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0]> : {{vf}}
        %q_hi = arith.constant dense<[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]> : {{vf}}
        // lane b's nibble starts at bit 4 x (b % 8): its bit 3 to bit 31
        %bit3_shift = arith.constant dense<[{{ lane_bit3 | join(", ") }}]> : {{vi}}
{% endif %}
{% endif %}
        %x = stream.binding.subspan %x_b[%c0] : !stream.binding -> memref<{{R}}x{{K}}xf32>
        %w = stream.binding.subspan %w_b[%c0] : !stream.binding -> {{w_mem}}
        %s = stream.binding.subspan %s_b[%c0] : !stream.binding -> {{s_mem}}
        %y = stream.binding.subspan %y_b[%c0] : !stream.binding -> memref<{{R}}x{{O}}xf32>
        %wg = stream.dispatch.workgroup.id[0] : index
{% if gathered %}
        %ex = stream.binding.subspan %ex_b[%c0] : !stream.binding -> memref<{{R}}xi32>
        %c_last_expert = arith.constant {{E - 1}} : index
{% endif %}
{% if batched %}
        // workgroup wg: outputs wg * o_tile .. of every row; expert e's rows m x E + e in runs of {{run_sizes[0]}}
        %c_experts = arith.constant {{E}} : index
        %c_m = arith.constant {{R // E}} : index
        %c_m_full = arith.constant {{(R // E) - (R // E) % run_sizes[0]}} : index
        %c_run = arith.constant {{run_sizes[0]}} : index
        %o_base = arith.muli %wg, %c_otile : index
        scf.for %e = %c0 to %c_experts step %c1 {
          scf.for %m = %c0 to %c_m_full step %c_run {
{{ outputs(run_sizes[0]) }}
          }
          scf.for %m = %c_m_full to %c_m step %c1 {
{{ outputs(1) }}
          }
        }
{% elif run_sizes %}
        // workgroup wg: outputs wg * o_tile .. of every row, walked in runs of rows with one expert
        %c_rows = arith.constant {{R}} : index
        %o_base = arith.muli %wg, %c_otile : index
{{ runs.walk_rows(R, run_sizes, outputs) }}
{% else %}
        // workgroup wg: row r = wg / (O / o_tile), that row's tile wg % (O / o_tile)
        %r = arith.divui %wg, %c_tiles : index
        %tile = arith.remui %wg, %c_tiles : index
{% if gathered %}
        %id = memref.load %ex[%r] : memref<{{R}}xi32>
{{ runs.expert_of("%id", "%e") }}
{% else %}
        %e = arith.constant 0 : index
{% endif %}
        %o_base = arith.muli %tile, %c_otile : index
{{ outputs(1) }}
{% endif %}
        return
    }
  }
}

util.func private @{{name}}(%x3: tensor<{{N}}x{{J}}x{{K}}xf32>, %codes: {{wt}}, %scales: {{st}}{{ (", %experts: tensor<" ~ N ~ "x" ~ J ~ "xi64>") if gathered }}) -> tensor<{{N}}x{{J}}x{{O}}xf32> {
  %xr = tensor.collapse_shape %x3 [[0, 1], [2]] : tensor<{{N}}x{{J}}x{{K}}xf32> into {{xt}}
{% if gathered %}
  %er = tensor.collapse_shape %experts [[0, 1]] : tensor<{{N}}x{{J}}xi64> into tensor<{{R}}xi64>
{{ runs.ids_i32("%er", "%ids", R) }}
  %yr = flow.dispatch @{{rows}}_dispatch::@{{rows}}(%xr, %codes, %scales, %ids) : ({{xt}}, {{wt}}, {{st}}, tensor<{{R}}xi32>) -> {{yt}}
{% else %}
  %yr = flow.dispatch @{{rows}}_dispatch::@{{rows}}(%xr, %codes, %scales) : ({{xt}}, {{wt}}, {{st}}) -> {{yt}}
{% endif %}
  %y = tensor.expand_shape %yr [[0, 1], [2]] output_shape [{{N}}, {{J}}, {{O}}] : {{yt}} into tensor<{{N}}x{{J}}x{{O}}xf32>
  util.return %y : tensor<{{N}}x{{J}}x{{O}}xf32>
}
