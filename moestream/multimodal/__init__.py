"""Image inputs for multimodal checkpoints (Qwen3.5-MoE): preprocessing and placeholder
expansion (`processor`), M-RoPE positions (`mrope`), the vision tower (`vision`)."""
