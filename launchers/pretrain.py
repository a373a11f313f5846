#!/usr/bin/env python
"""Pretraining entry point.

    deepspeed launchers/pretrain.py --ds_config zero3.json                  # one rank per NUMA node
    deepspeed --num_gpus 2 launchers/pretrain.py --ds_config zero3.json     # 2 ranks
    torchrun --nproc_per_node 2 launchers/pretrain.py --ds_config zero2 train.max_steps=50
"""
from dr_scale.launch import main

if __name__ == "__main__":
    main()
