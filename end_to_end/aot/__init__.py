"""TPU ahead-of-time compile reports (no TPU needed): the denoise step, text encoder, VAE decode, collectives."""
