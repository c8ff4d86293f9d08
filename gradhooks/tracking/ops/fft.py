"""Fourier transforms."""

from __future__ import annotations

from ..layout import MIXED, UNKNOWN
from .common import HANDLERS, Handler, arg, handles, norm_dim, single_input


@handles("fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_hfft", "fft_ihfft")
def _fft(args, kwargs, out, layout_of):
    """A Fourier transform along one dimension (``dim``, the last by default): along the
    batch it mixes the examples; along another, the layout stays (an FFT convolution along
    the sequence, as Hyena's)."""
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    dim = arg(args, kwargs, 2, "dim", -1)
    return MIXED if norm_dim(int(dim), t.dim()) == lay.dim else lay


def _fft_along(default: tuple[int, ...] | None) -> Handler:
    """A Fourier transform along several dimensions (``dim``; by default the last two for the
    2-d ones, the last ``len(s)`` or all for the n-d ones, ``default=None``)."""

    def handler(args, kwargs, out, layout_of):
        t, lay = single_input(args, kwargs, layout_of)
        if t is None or lay is UNKNOWN:
            return UNKNOWN
        dim, s = arg(args, kwargs, 2, "dim", default), arg(args, kwargs, 1, "s")
        if dim is None:
            n = len(s) if s is not None else t.dim()
            dims = list(range(t.dim() - n, t.dim()))
        else:
            items = dim if isinstance(dim, list | tuple) else [dim]
            dims = [norm_dim(int(d), t.dim()) for d in items]
        return MIXED if lay.dim in dims else lay

    return handler


for _n in ("fft_fft2", "fft_ifft2", "fft_rfft2", "fft_irfft2", "fft_hfft2", "fft_ihfft2"):
    HANDLERS[_n] = _fft_along((-2, -1))
for _n in ("fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn", "fft_hfftn", "fft_ihfftn"):
    HANDLERS[_n] = _fft_along(None)


@handles("stft")
def _stft(args, kwargs, out, layout_of):
    """A short-time Fourier transform of ``[time]`` or ``[batch, time]`` (the frames cut along
    the last dimension and transformed): the examples along dimension 0 of a 2-d input stay
    there, ``[batch, freq, frames(, 2)]``; along the time they mix."""
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    return lay if t.dim() == 2 and lay.dim == 0 else MIXED


@handles("istft")
def _istft(args, kwargs, out, layout_of):
    """Its inverse, of ``[freq, frames]`` or ``[batch, freq, frames]`` (complex): the examples
    along dimension 0 of a 3-d input stay there, ``[batch, time]``; along the frequencies or
    the frames they mix."""
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    return lay if t.dim() == 3 and lay.dim == 0 else MIXED
