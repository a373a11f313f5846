"""Parallelism applied around the plain model: topology (data x tensor x pipeline), tensor
parallel plans (through DeepSpeed AutoTP), activation checkpointing."""
