"""Plain PyTorch versions of the level quantizers, the baseline of the GPU speed comparison.

Written the way research code usually is: buckets as a padded 2-D view, ``torch.rand_like``
for the random rounding (a tensor of random numbers in memory), elementwise ops, one uint8 code
per element (not bit-packed, which only favours this version: it writes fewer bytes per
element than a packer would read back). Statistically the same quantizer as the codec (same
levels, same unbiased rounding); not bit-identical (different random numbers).
"""
from __future__ import annotations

from typing import Any


def _kind(codec: Any) -> tuple[int, int, float]:
    from horovod_quant.core.quantizers import LevelQuantizer

    if not isinstance(codec, LevelQuantizer):
        raise NotImplementedError(f"torch_reference_encode covers the level quantizers "
                                  f"(qsgd, nuqsgd, natural, natural_dithering, "
                                  f"standard_dithering), not {codec.name}")
    return codec.grid, codec.norm_kind, float(codec.p)


def torch_reference_encode(codec: Any, x: Any, generator: Any = None) -> dict[str, Any]:
    """Quantize tensor ``x`` like ``codec`` does, in plain PyTorch.

    Returns:
        ``{"scale": float32 per bucket, "codes": uint8 sign << (bits - 1) | level, "size": n}``.
    """
    import torch

    import horovod_quant.backends as K

    grid, kind, p = _kind(codec)
    v = x.reshape(-1).float()
    n = v.numel()
    bucket = codec._bucket(n)
    nb = max(1, -(-n // bucket))
    xb = torch.nn.functional.pad(v, (0, nb * bucket - n)).view(nb, bucket)
    a = xb.abs()
    if kind == K.NORM_L2:
        scale = torch.linalg.vector_norm(xb, dim=1)
    elif kind == K.NORM_MAX:
        scale = a.amax(dim=1)
    elif kind == K.NORM_P:
        scale = torch.linalg.vector_norm(xb, ord=p, dim=1)
    else:  # smallest power of two >= max|x|
        m = a.amax(dim=1)
        scale = torch.where(m > 0, torch.exp2(torch.ceil(torch.log2(m))), m)
    r = torch.nan_to_num(a / scale[:, None], nan=0.0).clamp_(max=1.0)
    u = torch.rand(r.shape, device=r.device, dtype=r.dtype, generator=generator)
    s = codec.s
    if grid == K.MODE_UNIFORM:
        t = r * s
        lvl = torch.floor(t)
        mag = lvl + (u < t - lvl).to(t.dtype)
    else:
        low = 2.0 ** (1 - s)
        e = torch.floor(torch.log2(torch.clamp(r, min=low)))
        lower = torch.exp2(e)
        up = (u < (r - lower) / lower).to(r.dtype)
        mag_hi = e + s + up
        mag_lo = (u < r / low).to(r.dtype)
        mag = torch.where(r >= low, mag_hi, mag_lo)
    sign = ((xb < 0) & (mag > 0)).to(torch.uint8) << (codec.bits - 1)
    codes = mag.to(torch.uint8) | sign
    return {"scale": scale, "codes": codes.reshape(-1)[:n], "size": n}


def torch_reference_decode(codec: Any, enc: dict[str, Any], out: Any = None) -> Any:
    """Inverse of :func:`torch_reference_encode`: ``table[code] * scale`` per element."""
    import torch

    _kind(codec)
    codes, scale, n = enc["codes"], enc["scale"], enc["size"]
    table = torch.as_tensor(codec.table, device=codes.device)
    bucket = codec._bucket(n)
    nb = scale.numel()
    vals = torch.nn.functional.pad(table[codes.long()], (0, nb * bucket - n)).view(nb, bucket)
    res = (vals * scale[:, None]).reshape(-1)[:n]
    if out is None:
        return res
    out.copy_(res)
    return out

