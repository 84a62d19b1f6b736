"""The compiled library's switch for attention on the AMX tile unit: decode attention on a
bfloat16 cache (csrc/paged_decode_amx.c), on an int8 cache where the CPU also has AMX-INT8
(csrc/paged_decode_int8_amx.h), and prefill attention (csrc/paged_prefill_amx.h), where the CPU
has AMX-BF16 and the shape allows (head_dim 64; decode: blocks of a multiple of 16 tokens). Elsewhere the AVX-512 / vector passes run. The switch is the library's, so it holds for
every caller in the process (the fused decode layers too); on by default.
"""
from __future__ import annotations

import ctypes


def use_amx_attention(library: ctypes.CDLL, enable: bool) -> bool:
    """Sets the switch; True when asked for and the library and CPU have AMX-BF16 (and the kernel
    granted the tile state)."""
    function = library.attention_amx_enable
    function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
    return bool(function(int(enable)))


def amx_attention_in_use(library: ctypes.CDLL) -> bool:
    function = library.attention_amx_enabled
    function.argtypes, function.restype = [], ctypes.c_int
    return bool(function())
