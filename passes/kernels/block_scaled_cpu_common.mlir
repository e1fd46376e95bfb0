{#- Pieces shared by the llvm-cpu FP8 / INT4 kernels (passes/block_scaled.py `cpu_function`). -#}

{#- The contraction body's weight: f32 %wv from the code %code (i8 FP8 byte, or i32 INT4 word of which
    lane %b's nibble), with the block scale read at expert `e`, row %o, K step %g. -#}
{% macro weight(fmt, e, lanes, scales_t) %}
{% if fmt == "bf16" %}
      // bf16 -> f32: the bits shifted into the high half (exact)
      %c16_bf = arith.constant 16 : i32
      %bits16 = arith.bitcast %code : bf16 to i16
      %bits32 = arith.extui %bits16 : i16 to i32
      %bits_hi = arith.shli %bits32, %c16_bf : i32
      %wv = arith.bitcast %bits_hi : i32 to f32
{% elif fmt == "fp8_e4m3_b128" %}
      // E4M3 -> f16 bits: (e m) -> bits 13..7, sign -> bit 15. The f16 is the E4M3 value * 2^-8 exactly,
      // subnormals included (f16 subnormals convert exactly: DAZ/FTZ act on f32 inputs, not on f16).
      %c7_16 = arith.constant 7 : i16
      %c8_16 = arith.constant 8 : i16
      %c127_16 = arith.constant 127 : i16
      %c0x3f80 = arith.constant 16256 : i16       // 0x3F80: bits 13..7
      %c0x8000 = arith.constant -32768 : i16      // 0x8000: sign
      %c_nan16 = arith.constant 0x7E00 : f16
      %code16 = arith.extui %code : i8 to i16
      %em0 = arith.shli %code16, %c7_16 : i16
      %em1 = arith.andi %em0, %c0x3f80 : i16
      %sg0 = arith.shli %code16, %c8_16 : i16
      %sg1 = arith.andi %sg0, %c0x8000 : i16
      %h = arith.ori %em1, %sg1 : i16
      %hf0 = arith.bitcast %h : i16 to f16
      // S.1111.111 is E4M3FN's NaN (as the reference decodes it)
      %low7 = arith.andi %code16, %c127_16 : i16
      %is_nan = arith.cmpi eq, %low7, %c127_16 : i16
      %hf = arith.select %is_nan, %c_nan16, %hf0 : f16
      %v = arith.extf %hf : f16 to f32
      // the block scale times 2^8 (cancels the decode's 2^-8): v * s in one rounding, as the reference
      %c128 = arith.constant 128 : index
      %c_lanes = arith.constant {{lanes}} : index
      %o_block = arith.divui %o, %c128 : index
      %k = arith.muli %g, %c_lanes : index
      %k_block = arith.divui %k, %c128 : index
      %s = tensor.extract %scales[{{e}}, %o_block, %k_block] : {{scales_t}}
      %c256 = arith.constant 256.0 : f32
      %s8 = arith.mulf %s, %c256 : f32
      %wv = arith.mulf %v, %s8 : f32
{% else %}
      // nibble b of the word (low nibble first), offset binary u = q + 8
      %c4 = arith.constant 4 : i32
      %c8 = arith.constant 8 : i32
      %c15 = arith.constant 15 : i32
      %b32 = arith.index_cast %b : index to i32
      %shift = arith.muli %b32, %c4 : i32
      %shifted = arith.shrui %code, %shift : i32
      %u = arith.andi %shifted, %c15 : i32
      %q = arith.subi %u, %c8 : i32
      %qf = arith.sitofp %q : i32 to f32
      // the group scale (32 = 4 words), then the product rounded to bf16 (compressed-tensors' bf16 multiply)
      %c4_index = arith.constant 4 : index
      %group = arith.divui %g, %c4_index : index
      %sb = tensor.extract %scales[{{e}}, %o, %group] : {{scales_t}}
      %scale = arith.extf %sb : bf16 to f32
      %product = arith.mulf %qf, %scale : f32
      %c1 = arith.constant 1 : i32
      %c16 = arith.constant 16 : i32
      %c0x7fff = arith.constant 32767 : i32
      %c_high = arith.constant -65536 : i32
      %bits = arith.bitcast %product : f32 to i32
      %lsb0 = arith.shrui %bits, %c16 : i32
      %lsb = arith.andi %lsb0, %c1 : i32
      %bias = arith.addi %lsb, %c0x7fff : i32
      %sum = arith.addi %bits, %bias : i32
      %rounded = arith.andi %sum, %c_high : i32
      %wv = arith.bitcast %rounded : i32 to f32
{% endif %}
{% endmacro %}
