"""dr_scale: DeepSpeed-centric pretraining of decoder language models."""
from setuptools import find_packages, setup

# The top-level kernels/ folder is installed as `dr_scale.kernels`: PyPI has an unrelated
# `kernels` package that other libraries import when present, so a bare `kernels` would clash.
packages = find_packages(include=["dr_scale", "dr_scale.*"])
packages += ["dr_scale.kernels"] + [
    "dr_scale.kernels." + p for p in find_packages(where="kernels")
]
# The top-level ds_configs/ (DeepSpeed JSON only) travels as data inside the package, so an
# installed dr_scale resolves `--ds_config zero3` from any directory.
packages += ["dr_scale.ds_configs"]

setup(
    name="dr_scale",
    version="0.1.0",
    description="Pretraining decoder language models with DeepSpeed, from one CPU to many GPU nodes",
    python_requires=">=3.11",
    packages=packages,
    package_dir={"dr_scale.kernels": "kernels", "dr_scale.ds_configs": "ds_configs"},
    package_data={"dr_scale": ["data/corpus/*.jsonl.gz", "data/corpus/*.md"],
                  "dr_scale.ds_configs": ["*.json"],
                  # the fused kernels are built from source on first use, also when installed
                  "dr_scale.kernels.cuda": ["*.cu", "*.cuh", "*.h", "*.cpp"]},
    # The lower bounds are versions CI runs (the README's "Test" section): the suite on torch
    # 2.13, its smoke stage on torch 2.11 (the GPU image's) with transformers 5.17, Triton 3.6
    # and NumPy 2.3; DeepSpeed 0.19.8, the only release run here, in both.
    install_requires=[
        "torch>=2.11",
        "deepspeed>=0.19.8",
        "sentencepiece>=0.2",
        "numpy>=2.3",
        "pyyaml>=6",
        "matplotlib>=3.7",
        "psutil>=5.9",
        "tokenizers>=0.15",
    ],
    extras_require={
        "tensorboard": ["tensorboard>=2.14"],
        "wandb": ["wandb>=0.16"],
        "megatron": ["megatron-core>=0.16"],
        "triton": ["triton>=3.6"],
        # .zst and Parquet inputs to `dr-scale preprocess`
        "data": ["zstandard>=0.22", "pyarrow>=14"],
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6", "triton>=3.6", "tensorboard>=2.14",
                "wandb>=0.16", "transformers>=5.17",
                "safetensors>=0.4", "zstandard>=0.22", "pyarrow>=14", "megatron-core>=0.16"],
    },
    entry_points={"console_scripts": ["dr-scale=dr_scale.cli:main"]},
)
