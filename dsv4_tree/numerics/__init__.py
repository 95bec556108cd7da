"""Numerical building blocks of the verify rows, each equal to its transformers module (casts,
RMSNorm, RoPE tables, mHC mixing, the MoE block). They know weights and tensors, not requests,
pools or plans; everything above (attention, serving, the executor, drafters) builds on them."""
