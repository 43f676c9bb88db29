"""Models built from any registered token mixer: an encoder of token sequences and a segmenter of
images (a global-context block in HamNet's layout)."""

from .encoder import NO_MIXING, AttentionMixer, Encoder, EncoderBlock, build_mixer, sinusoidal_positions
from .segmenter import Segmenter

__all__ = ["Encoder", "EncoderBlock", "AttentionMixer", "Segmenter", "build_mixer", "sinusoidal_positions",
           "NO_MIXING"]
