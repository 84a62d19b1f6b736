"""An independent NumPy model of the sampler's noise and draw, to check the kernel bit for bit."""
from __future__ import annotations

import numpy as np

M0, M1, W0, W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF


def philox4x32_10(c, k) -> np.ndarray:
    """Philox4x32-10 on counters c [4, n] and keys k [2] (uint32), returning [4, n]."""
    c = [np.asarray(x, dtype=np.uint64) for x in c]
    k0, k1 = int(k[0]), int(k[1])
    for _ in range(10):
        p0, p1 = c[0] * np.uint64(M0), c[2] * np.uint64(M1)
        hi0, lo0 = p0 >> np.uint64(32), p0 & np.uint64(MASK32)
        hi1, lo1 = p1 >> np.uint64(32), p1 & np.uint64(MASK32)
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
        k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
    return np.stack(c).astype(np.uint32)


def gumbel_noise(seed: int, offset: int, vocab_size: int) -> np.ndarray:
    """The noise sample_rows adds to token i: Philox at counter (i // 4, offset) word i % 4."""
    seed &= 2**64 - 1
    offset &= 2**64 - 1
    groups = np.arange(-(-vocab_size // 4), dtype=np.uint64)
    n = len(groups)
    words = philox4x32_10(
        [groups, np.full(n, offset & MASK32), np.full(n, offset >> 32), np.zeros(n)],
        [seed & MASK32, seed >> 32],
    )
    bits = words.T.reshape(-1)[:vocab_size]
    u = ((bits >> 8).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
    return -np.log(-np.log(u))


def expected_draw(logits: np.ndarray, temperature: float, kept: np.ndarray, seed: int, offset: int) -> int:
    """argmax over kept tokens of logit / T + noise, ties to the lowest index."""
    inv_t = np.float32(1.0) / np.float32(temperature)
    keys = logits.astype(np.float32) * inv_t + gumbel_noise(seed, offset, len(logits))
    keys = np.where(kept, keys, -np.inf)
    return int(np.argmax(keys))
