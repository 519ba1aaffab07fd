"""HiFT vocoder of CosyVoice2 (inference only): 80-bin mel at 50 Hz -> 24 kHz waveform.

HiFT combines a neural source-filter excitation with an iSTFT head:

1. a convolutional F0 predictor estimates the pitch of every mel frame;
2. the pitch drives a harmonic source (sines at F0 and its overtones, unvoiced frames get noise),
   merged into one excitation signal at the audio rate;
3. the mel goes through ``conv_pre`` and transposed-convolution upsampling stages with
   multi-receptive-field residual blocks (Snake activations); after each stage the STFT of the
   excitation, strided down to that stage's rate, is added in;
4. ``conv_post`` predicts a log-magnitude and a phase spectrogram and an inverse STFT
   (``n_fft`` 16, hop 4 for CosyVoice2) turns them into samples, clamped to ``audio_limit``.

Module and parameter names follow upstream's ``cosyvoice.hifigan.generator.HiFTGenerator`` so the
released ``hift.pt`` loads with ``strict=True``. Weight norm uses ``torch.nn.utils.parametrizations``,
whose keys (``*.parametrizations.weight.original0/1``) are the ones ``hift.pt`` stores; checkpoints
written with the legacy ``weight_g``/``weight_v`` names load too (torch converts them on load).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

if TYPE_CHECKING:
    from tts_gateway.models.cosyvoice2.model.config import HiftConfig

Generators = torch.Generator | Sequence[torch.Generator | None] | None

_SNAKE_EPS = 1e-9
_MAX_MAGNITUDE = 1e2
# The window envelope past a padded row's end, where no frame overlaps (those samples are discarded).
_EMPTY_ENVELOPE = 1e-6


class ExcitationNoise(NamedTuple):
    """The excitation's random draws, made apart from vocoding so that a recorded CUDA graph holds no RNG."""

    phase: Tensor  # [B, harmonics] initial phase of every overtone, in cycles (the fundamental's is ignored)
    gaussian: Tensor  # [B, harmonics, samples] standard normal noise


def _draw(generator: Generators, rows: int, draw: Callable[[int, torch.Generator | None], Tensor]) -> Tensor:
    """``draw(rows, generator)`` with one generator, or row by row with one generator per row."""
    if generator is None or isinstance(generator, torch.Generator):
        return draw(rows, generator)
    if len(generator) != rows:
        raise ValueError(f"{len(generator)} generators for {rows} rows")
    return torch.cat([draw(1, row_generator) for row_generator in generator])


def _same_padding(kernel_size: int, dilation: int) -> int:
    return (kernel_size - 1) * dilation // 2


def _inside(valid: Tensor | None, length: int) -> Tensor | None:
    """Which of ``length`` positions [B, 1, length] lie within each row's ``valid`` length (None: all do).

    Built once per rate of a padded batch, for every :func:`_keep` at that rate."""
    if valid is None:
        return None
    return (torch.arange(length, device=valid.device) < valid[:, None]).unsqueeze(1)


def _keep(x: Tensor, inside: Tensor | None) -> Tensor:
    """``x`` [B, C, L] with each row's positions outside its length (``inside``, from :func:`_inside`) zeroed.

    Rows of different lengths vocoded as one right-padded batch: a convolution then reads zeros past
    a row's end, as the zero padding of that row vocoded alone does, so every row's own samples come
    out as they would alone. ``None``: one length, nothing to clear."""
    return x if inside is None else torch.where(inside, x, 0.0)


@functools.cache
def _fourier_bases(n_fft: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """HiFT's short-time Fourier transforms as matrices: the window and the forward and inverse real DFT.

    At 16 points a product with these matrices is as cheap as an FFT, and it is what lets a CUDA
    graph record HiFT: ``torch.istft`` checks its window envelope on the host (a device sync), and
    a cuFFT plan that a graph recorded could be evicted from torch's plan cache while the graph
    lives (the Hann window at hop 4 never fails the envelope check, so it is not repeated).
    Returns the periodic Hann window [n_fft] (as scipy's ``get_window("hann")``), the forward basis
    [n_fft, 2 * bins] (real parts, then imaginary) and the inverse bases of the real and imaginary
    parts [bins, n_fft], which ignore the imaginary parts of the first and last bin as ``irfft`` does.
    """
    with torch.inference_mode(False):  # cached across calls: not inference tensors
        window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64)
        bins = n_fft // 2 + 1
        angle = 2 * math.pi * torch.outer(torch.arange(n_fft, dtype=torch.float64), torch.arange(bins).double()) / n_fft
        forward = torch.cat([torch.cos(angle), -torch.sin(angle)], dim=1)
        # Every bin but the first and the last stands for itself and its conjugate mirror.
        weights = torch.full((bins, 1), 2.0, dtype=torch.float64)
        weights[0] = 1.0
        if n_fft % 2 == 0:
            weights[-1] = 1.0  # the Nyquist bin is its own mirror
        inverse_real = weights * torch.cos(angle.T) / n_fft
        inverse_imag = -weights * torch.sin(angle.T) / n_fft
        window, forward, inverse_real, inverse_imag = (
            t.to(device=device, dtype=torch.float32) for t in (window, forward, inverse_real, inverse_imag)
        )
    return window, forward, inverse_real, inverse_imag


def snake(x: Tensor, alpha: Tensor) -> Tensor:
    """Periodic activation ``x + sin^2(alpha * x) / alpha`` of ``x`` ``[B, C, T]``, ``alpha`` ``[C]`` per channel."""
    alpha = alpha[None, :, None]
    return x + (1.0 / (alpha + _SNAKE_EPS)) * torch.sin(x * alpha).pow(2)


class Snake(nn.Module):
    """:func:`snake` with a learned ``alpha`` per channel.

    ``activation`` computes it: :func:`snake` itself, or the same compiled
    (:func:`~tts_gateway.models.cosyvoice2.engines.hift_compile.compile_hift_activations`)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))
        self.activation: Callable[[Tensor, Tensor], Tensor] = snake

    def forward(self, x: Tensor) -> Tensor:
        # Detached, alpha is a plain tensor to a compiler, whose sizes may be symbolic as the input's are
        # (a parameter's are fixed, and would fix the input's channels to them: a compile per width).
        return self.activation(x, self.alpha.detach())


class ResBlock(nn.Module):
    """Residual stack: per dilation, Snake -> dilated conv -> Snake -> conv, added to the input."""

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=_same_padding(kernel_size, d)))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, padding=_same_padding(kernel_size, 1)))
            for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor, inside: Tensor | None = None) -> Tensor:
        """``inside``: each row's positions when rows are padded (:func:`_inside`; ``x`` is zero past them,
        and so is the result)."""
        for conv1, conv2, act1, act2 in zip(
            self.convs1, self.convs2, self.activations1, self.activations2, strict=True
        ):
            # Snake(0) = 0: an input cleared past a row's end stays cleared through the activations.
            x = _keep(x + conv2(act2(_keep(conv1(act1(x)), inside))), inside)
        return x


class ConvRNNF0Predictor(nn.Module):
    """Frame-level F0 (Hz, non-negative) from the mel: five conv+ELU layers and a linear head."""

    def __init__(self, in_channels: int, cond_channels: int, num_class: int = 1, num_layers: int = 5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for index in range(num_layers):
            source = in_channels if index == 0 else cond_channels
            layers += [weight_norm(nn.Conv1d(source, cond_channels, kernel_size=3, padding=1)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: Tensor, frames: Tensor | None = None) -> Tensor:
        """``mel`` [B, 80, T] -> F0 [B, T]; ``frames``: each row's frames when rows are padded (ELU(0) = 0)."""
        inside = _inside(frames, mel.shape[2])
        hidden = _keep(mel, inside)
        for layer in self.condnet:
            hidden = _keep(layer(hidden), inside) if isinstance(layer, nn.Conv1d) else layer(hidden)
        hidden = hidden.transpose(1, 2)
        f0: Tensor = self.classifier(hidden).squeeze(-1).abs()
        return f0


class HarmonicSource(nn.Module):
    """Neural source-filter excitation (upstream's ``SourceModuleHnNSF2`` + ``SineGen2``).

    F0 is held per frame, turned into per-sample phase increments for the fundamental and
    ``nb_harmonics`` overtones, integrated at the frame rate and linearly interpolated back to
    the audio rate (integrating at the frame rate keeps the phase smooth where F0 jumps).
    Voiced samples (F0 above ``voiced_threshold``) carry ``sine_amp`` sines plus weak noise,
    unvoiced ones noise only; a linear layer + tanh merges the harmonics into one channel.

    Two random draws make the excitation stochastic, in upstream's order so that equal RNG
    states give equal output: a random initial phase per overtone, then the additive noise.
    :meth:`draw_noise` makes them; :meth:`forward` is deterministic given them. (The initial phase
    is added at each overtone's first sample, which the frame-rate resampling never reads: it
    changes nothing, in upstream's code too, but drawing it keeps the noise after it in step.)
    """

    def __init__(
        self,
        sampling_rate: int,
        upsample_scale: int,
        nb_harmonics: int,
        sine_amp: float,
        noise_std: float,
        voiced_threshold: float,
    ) -> None:
        super().__init__()
        self.sampling_rate = sampling_rate
        self.upsample_scale = upsample_scale
        self.nb_harmonics = nb_harmonics
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold
        self.l_linear = nn.Linear(nb_harmonics + 1, 1)

    def draw_noise(self, rows: int, samples: int, generator: Generators, device: torch.device) -> ExcitationNoise:
        """The random draws of ``rows`` excitations of ``samples`` samples.

        ``generator`` is one generator for the whole batch or one per row (each row then draws
        exactly what it would draw alone); ``None`` draws from torch's global RNG.
        """
        harmonics = self.nb_harmonics + 1
        phase = _draw(
            generator,
            rows,
            lambda n, g: torch.rand(n, harmonics, generator=g, device=device, dtype=torch.float32),
        )
        # Upstream fills this noise through a [B, samples, harmonics] view of [B, harmonics, samples]
        # memory, and torch's normal_ orders its draws differently for such strided views.
        gaussian = _draw(
            generator,
            rows,
            lambda n, g: (
                torch.empty(n, harmonics, samples, device=device, dtype=torch.float32)
                .transpose(1, 2)
                .normal_(generator=g)
                .transpose(1, 2)
            ),
        )
        return ExcitationNoise(phase, gaussian)

    def forward(self, f0: Tensor, noise: ExcitationNoise, valid: Tensor | None = None) -> Tensor:
        """``f0`` [B, T] in Hz and the draws of :meth:`draw_noise` -> excitation [B, 1, T * upsample_scale].

        ``valid``: each row's frames when rows are padded; a row's samples past them are not its own."""
        scale = float(self.upsample_scale)
        f0 = F.interpolate(f0.float()[:, None], scale_factor=scale, mode="nearest")
        orders = torch.arange(1, self.nb_harmonics + 2, dtype=torch.float32, device=f0.device)[None, :, None]
        # [B, harmonics, samples]; the per-sample phase increment in cycles.
        increments = (f0 * orders / self.sampling_rate) % 1
        # The fundamental starts at phase 0; the draws are left as they are (they may be a graph's inputs).
        initial_phase = torch.cat([torch.zeros_like(noise.phase[:, :1]), noise.phase[:, 1:]], dim=1)
        increments[:, :, 0] = increments[:, :, 0] + initial_phase

        per_frame = F.interpolate(increments, scale_factor=1 / scale, mode="linear")
        phase = torch.cumsum(per_frame, dim=2) * 2 * math.pi
        if valid is not None:
            # Resampled alone, a row's last half frame holds its last phase (the edge is clamped):
            # the frames after it repeat that phase.
            last = torch.minimum(torch.arange(phase.shape[2], device=phase.device), valid[:, None] - 1)
            phase = phase.gather(2, last[:, None, :].expand_as(phase))
        phase = F.interpolate(phase * scale, scale_factor=scale, mode="linear")
        sines = torch.sin(phase) * self.sine_amp

        voiced = (f0 > self.voiced_threshold).float()
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        excitation = (sines * voiced + noise_amp * noise.gaussian).transpose(1, 2)
        merged = torch.tanh(self.l_linear(excitation.to(self.l_linear.weight.dtype)))
        return merged.transpose(1, 2)


class HiFTGenerator(nn.Module):
    """The HiFT vocoder; its state dict has exactly the keys and shapes of upstream's ``hift.pt``."""

    def __init__(self, cfg: HiftConfig) -> None:
        super().__init__()
        if cfg.sampling_rate == 22050:
            raise ValueError("the 22.05 kHz CosyVoice 1 source module is not implemented; CosyVoice2 uses 24 kHz")
        upsample_rates = list(cfg.upsample_rates)
        if not len(upsample_rates) == len(cfg.upsample_kernel_sizes) == len(cfg.source_resblock_kernel_sizes):
            raise ValueError("upsample_rates, upsample_kernel_sizes and source_resblock_kernel_sizes differ in length")
        self.n_fft = cfg.istft_n_fft
        self.hop_len = cfg.istft_hop_len
        self.lrelu_slope = cfg.lrelu_slope
        self.audio_limit = cfg.audio_limit
        self.num_kernels = len(cfg.resblock_kernel_sizes)
        self.num_upsamples = len(upsample_rates)
        self.samples_per_frame = math.prod(upsample_rates) * self.hop_len
        base = cfg.base_channels
        spectrum_channels = self.n_fft + 2

        self.m_source = HarmonicSource(
            sampling_rate=cfg.sampling_rate,
            upsample_scale=self.samples_per_frame,
            nb_harmonics=cfg.nb_harmonics,
            sine_amp=cfg.nsf_alpha,
            noise_std=cfg.nsf_sigma,
            voiced_threshold=cfg.nsf_voiced_threshold,
        )
        self.conv_pre = weight_norm(nn.Conv1d(cfg.in_channels, base, 7, 1, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(base // 2**i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(upsample_rates, cfg.upsample_kernel_sizes, strict=True))
        )

        # Stage i runs at prod(upsample_rates[:i + 1]) x the frame rate; the excitation's STFT runs
        # at prod(upsample_rates) x, so stage i sees it strided by the product of the later rates.
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (kernel, dilations) in enumerate(
            zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes, strict=True)
        ):
            stride = math.prod(upsample_rates[i + 1 :])
            channels = base // 2 ** (i + 1)
            if stride == 1:
                down = nn.Conv1d(spectrum_channels, channels, 1, 1)
            else:
                down = nn.Conv1d(spectrum_channels, channels, stride * 2, stride, padding=stride // 2)
            self.source_downs.append(down)
            self.source_resblocks.append(ResBlock(channels, kernel, dilations))

        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), kernel, dilations)
            for i in range(self.num_upsamples)
            for kernel, dilations in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = weight_norm(nn.Conv1d(base // 2**self.num_upsamples, spectrum_channels, 7, 1, padding=3))
        self.reflection_pad = nn.ReflectionPad1d((1, 0))
        self.f0_predictor = ConvRNNF0Predictor(
            in_channels=cfg.f0_in_channels, cond_channels=cfg.f0_cond_channels, num_class=cfg.f0_num_class
        )

    @classmethod
    def from_checkpoint(
        cls, cfg: HiftConfig, path: Path, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> HiFTGenerator:
        """Build from ``cfg``, load ``hift.pt`` strictly (a ``generator.`` prefix is accepted) and
        fold the weight norm for inference (see :meth:`fold_weight_norm`)."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = {key.removeprefix("generator."): value for key, value in state.items()}
        model = cls(cfg)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise RuntimeError(f"{path} does not match the hift hyperparameters of cosyvoice2.yaml: {exc}") from exc
        model.fold_weight_norm()
        return model.to(device=device, dtype=dtype).eval()

    def fold_weight_norm(self) -> None:
        """Replace every weight-normed weight by its value ``g * v / |v|``, computed once.

        The outputs stay bit-identical; inference no longer renormalises 20 M weights per call and
        needs no process-wide parametrization cache (unsafe with concurrent requests). The state
        dict then holds plain ``weight`` keys instead of ``parametrizations.weight.original0/1``.
        """
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)

    def _source_spectrum(self, source: Tensor, samples: Tensor | None = None) -> Tensor:
        """``torch.stft`` of the excitation (centred, reflect-padded, Hann window): real then imaginary bins.

        ``samples``: each row's length when rows are padded; a row is reflected at its own end."""
        window, forward, _, _ = _fourier_bases(self.n_fft, source.device)
        half = self.n_fft // 2
        if samples is None:
            padded = F.pad(source.float(), (half, half), mode="reflect").squeeze(1)
        else:
            length = source.shape[2]
            at = torch.arange(-half, length + half, device=source.device).expand(source.shape[0], -1)
            end = samples[:, None] - 1
            reflected = torch.where(at < 0, -at, torch.where(at > end, 2 * end - at, at))
            padded = source.float().squeeze(1).gather(1, reflected.clamp(0, length - 1))
        frames = padded.unfold(1, self.n_fft, self.hop_len) * window  # [B, frames, n_fft]
        return (frames @ forward).transpose(1, 2)

    def _inverse_stft(self, magnitude: Tensor, phase: Tensor, inside: Tensor | None = None) -> Tensor:
        """``torch.istft`` (centred, one-sided, Hann window) of the spectrum ``magnitude * exp(i * phase)``.

        ``inside``: each row's frames when rows are padded (:func:`_inside`); frames past them add nothing,
        to the signal or to the window envelope it is divided by."""
        window, _, inverse_real, inverse_imag = _fourier_bases(self.n_fft, magnitude.device)
        magnitude = _keep(magnitude.clamp(max=_MAX_MAGNITUDE), inside)
        real, imag = (magnitude * torch.cos(phase)).transpose(1, 2), (magnitude * torch.sin(phase)).transpose(1, 2)
        frames = ((real @ inverse_real + imag @ inverse_imag) * window).transpose(1, 2)  # [B, n_fft, frames]
        windows = (window * window)[None, :, None].expand(1, self.n_fft, frames.shape[2])
        if inside is not None:
            windows = _keep(windows.expand(frames.shape[0], -1, -1), inside)
        signal, envelope = (self._overlap_add(tensor) for tensor in (frames, windows))
        half = self.n_fft // 2
        signal, envelope = signal[:, half:-half], envelope[:, half:-half]
        if inside is not None:
            # Past a row's end nothing overlaps: keep those (discarded) samples finite.
            envelope = envelope.clamp(min=_EMPTY_ENVELOPE)
        return signal / envelope

    def _overlap_add(self, frames: Tensor) -> Tensor:
        """Frames [B, n_fft, T] laid ``hop_len`` apart and summed -> [B, (T - 1) * hop_len + n_fft]."""
        length = (frames.shape[2] - 1) * self.hop_len + self.n_fft
        summed = F.fold(frames, output_size=(1, length), kernel_size=(1, self.n_fft), stride=(1, self.hop_len))
        return summed.reshape(frames.shape[0], length)

    def decode(self, mel: Tensor, source: Tensor, frames: Tensor | None = None) -> Tensor:
        """Mel [B, 80, T] and excitation [B, 1, T * samples_per_frame] -> waveform [B, T * samples_per_frame].

        ``frames``: each row's mel frames when rows of different lengths are padded to T (see :func:`_keep`)."""
        # Each row's positions at each rate: stage i runs at prod(upsample_rates[:i + 1]) x the frame rate.
        length = mel.shape[2]
        rate = 1
        stages: list[Tensor | None] = []
        for up in self.ups:
            rate *= up.stride[0]
            stages.append(None if frames is None else _inside(frames * rate, length * rate))
        # The last stage gains one sample on the left (reflection_pad); the excitation's STFT has as many frames.
        spectrum = None if frames is None else _inside(frames * rate + 1, length * rate + 1)
        samples = None if frames is None else frames * self.samples_per_frame
        source_spec = _keep(self._source_spectrum(source, samples).to(mel.dtype), spectrum)
        at_frames = _inside(frames, length)
        x = _keep(self.conv_pre(_keep(mel, at_frames)), at_frames)
        for i in range(self.num_upsamples):
            x = self.ups[i](F.leaky_relu(x, self.lrelu_slope))
            inside = stages[i]
            if i == self.num_upsamples - 1:
                x = self.reflection_pad(x)
                inside = spectrum
            x = _keep(x + self.source_resblocks[i](_keep(self.source_downs[i](source_spec), inside), inside), inside)
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            total = blocks[0](x, inside)
            for block in blocks[1:]:
                total = total + block(x, inside)
            x = total / self.num_kernels
        # Upstream's last activation uses leaky_relu's default slope, not lrelu_slope.
        x = self.conv_post(F.leaky_relu(x)).float()
        bins = self.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :bins, :])
        phase = torch.sin(x[:, bins:, :])
        wav = self._inverse_stft(magnitude, phase, spectrum)
        return wav.clamp(-self.audio_limit, self.audio_limit)

    def vocode(
        self,
        mel: Tensor,
        noise: ExcitationNoise,
        cache_source: Tensor | None = None,
        frames: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """:meth:`inference` with the excitation's draws given: deterministic, and free of host syncs.

        ``mel`` must already be on the model's device and in its dtype. ``frames`` (a tensor on that
        device): each row's own frames, the rest of its mel padding; each row's waveform and
        excitation up to its own ``frames * samples_per_frame`` samples are then what vocoding that row
        alone gives (its noise drawn for its own length, zero-padded), the samples after it are not.
        """
        f0 = self.f0_predictor(mel, frames)
        source = self.m_source(f0, noise, frames)
        if cache_source is not None and cache_source.shape[2] > 0:
            cached = cache_source.shape[2]
            source = torch.cat([cache_source.to(source), source[:, :, cached:]], dim=2)
        return self.decode(mel, source, frames), source

    def padded(
        self, mels: Sequence[Tensor], noises: Sequence[ExcitationNoise]
    ) -> tuple[Tensor, ExcitationNoise, Tensor]:
        """Mels [B_i, 80, T_i] and their draws as one batch zero-padded to the longest, with each row's frames:
        what :meth:`vocode` takes to vocode each row as it would alone."""
        longest = max(mel.shape[2] for mel in mels)
        # The draws copied into one zeroed tensor: padding each part first would hold the noise, the
        # batch's largest input, three times over.
        gaussian = noises[0].gaussian.new_zeros(
            sum(part.gaussian.shape[0] for part in noises),
            noises[0].gaussian.shape[1],
            longest * self.samples_per_frame,
        )
        row = 0
        for part in noises:
            count, _, samples = part.gaussian.shape
            gaussian[row : row + count, :, :samples] = part.gaussian
            row += count
        noise = ExcitationNoise(torch.cat([part.phase for part in noises]), gaussian)
        frames = [mel.shape[2] for mel in mels for _ in range(mel.shape[0])]
        batch = torch.cat([F.pad(mel, (0, longest - mel.shape[2])) for mel in mels])
        return batch, noise, torch.tensor(frames, device=batch.device)

    def draw_noise(self, rows: int, frames: int, generator: Generators = None) -> ExcitationNoise:
        """The excitation's draws for ``rows`` mels of ``frames`` frames (see :meth:`HarmonicSource.draw_noise`)."""
        samples = frames * self.samples_per_frame
        return self.m_source.draw_noise(rows, samples, generator, self.conv_pre.bias.device)

    def inference(
        self, mel: Tensor, cache_source: Tensor | None = None, *, generator: Generators = None
    ) -> tuple[Tensor, Tensor]:
        """Vocode ``mel`` [B, 80, T] -> (waveform [B, T * 480], excitation [B, 1, T * 480]).

        ``cache_source`` (the excitation under the first frames, kept from the previous chunk of a
        stream) replaces the start of the new excitation so the harmonic phase stays continuous.
        ``generator`` seeds the excitation's random phase and noise (one for the batch, or one per
        row); ``None`` uses torch's global RNG.
        """
        reference = self.conv_pre.bias
        with torch.inference_mode():
            mel = mel.to(device=reference.device, dtype=reference.dtype)
            return self.vocode(mel, self.draw_noise(mel.shape[0], mel.shape[2], generator), cache_source)
