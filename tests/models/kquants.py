"""Test-only writers of llama.cpp's Q4_K and Q6_K blocks (the `gguf` package reads them but
cannot write them), so that the loader can be tested on files of those types.

Written here from the block layouts (256-value super-blocks). The quantisation is the plain
round-to-nearest kind, not llama.cpp's error-minimising search: the tests need valid files, not
the best ones. Each writer also returns what its blocks should dequantise to, so a test can
check the packing against the `gguf` package's reader exactly.
"""

from __future__ import annotations

import numpy as np

QK = 256


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if x.shape[-1] % QK:
        raise ValueError(f"rows of {x.shape[-1]} values are not a multiple of {QK}")
    return x.reshape(-1, QK)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def quantize_q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(bytes [rows, 210 * row/256], dequantised values)`` of ``x`` in Q6_K.

    A super-block: 16 sub-blocks of 16 values ``d * s_j * q``, ``q`` in [-32, 31] (6 bits: the
    low 4 in ``ql``, the high 2 in ``qh``), ``s_j`` int8, ``d`` float16.
    """
    b = _blocks(x)
    n = b.shape[0]
    sub = b.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31.0                              # [n, 16]
    d = (np.abs(scale).max(axis=-1) / 127.0).astype(np.float16)          # [n]
    s = np.clip(np.rint(_safe_div(scale, d.astype(np.float32)[:, None])), -128, 127)
    step = d.astype(np.float32)[:, None] * s                             # [n, 16]
    q = np.clip(np.rint(_safe_div(sub, step[..., None])), -32, 31).astype(np.int16)
    deq = (step[..., None] * q).reshape(n, QK)
    u = (q.reshape(n, QK) + 32).astype(np.uint8)                         # 0..63
    low, high = u & 0x0F, u >> 4
    # value e = h*128 + t*64 + p: low nibble at ql[h*64 + p] << 4t
    low = low.reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    # value e = h*128 + t*32 + p: high bits at qh[h*32 + p] << 2t
    high = high.reshape(n, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
          | (high[:, :, 3] << 6)).reshape(n, 64)
    raw = np.concatenate([ql, qh, s.astype(np.int8).view(np.uint8), _f16(d)], axis=1)
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    return raw.reshape(rows, -1), deq.reshape(x.shape)


def quantize_q4_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(bytes [rows, 144 * row/256], dequantised values)`` of ``x`` in Q4_K.

    A super-block: 8 sub-blocks of 32 values ``d * s_j * q - dmin * m_j``, ``q`` in [0, 15],
    ``s_j`` and ``m_j`` 6-bit (packed into 12 bytes), ``d`` and ``dmin`` float16.
    """
    b = _blocks(x)
    n = b.shape[0]
    sub = b.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)                               # [n, 8]
    scale = (sub.max(axis=-1) - lo) / 15.0
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = ((-lo).max(axis=-1) / 63.0).astype(np.float16)
    s = np.clip(np.rint(_safe_div(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(-lo, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * s
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint(_safe_div(sub + offset[..., None], step[..., None])), 0, 15)
    q = q.astype(np.uint8)
    deq = (step[..., None] * q - offset[..., None]).reshape(n, QK)
    # scales: bytes 0-3 s_j | (s_{j+4} >> 4) << 6; 4-7 m_j | (m_{j+4} >> 4) << 6;
    # 8-11 (s_{j+4} & 15) | (m_{j+4} & 15) << 4
    packed = np.concatenate([
        s[:, :4] | ((s[:, 4:] >> 4) << 6),
        m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (s[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1)
    # value e = k*64 + t*32 + p (sub-block 2k + t): nibble at qs[k*32 + p] << 4t
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    raw = np.concatenate([_f16(d), _f16(dmin), packed, qs], axis=1)
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    return raw.reshape(rows, -1), deq.reshape(x.shape)
