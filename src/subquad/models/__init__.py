"""Models built from any registered token mixer."""

from .encoder import AttentionMixer, Encoder, EncoderBlock, build_mixer, sinusoidal_positions

__all__ = ["Encoder", "EncoderBlock", "AttentionMixer", "build_mixer", "sinusoidal_positions"]
