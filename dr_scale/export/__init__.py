"""Moving weights between dr_scale checkpoints and Hugging Face folders."""
