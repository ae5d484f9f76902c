from setuptools import find_packages, setup

setup(
    name="bstrain",
    version="0.1.0",
    description="Block-sparse training toolkit: PyTorch + Triton rebuild of OpenAI's blocksparse",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # Only bstrain.* goes to site-packages: no top-level kernels/ops/models packages.
    packages=find_packages(include=["bstrain", "bstrain.*"]),
    package_data={"bstrain": ["configs/**/*.yaml", "measurements/*.csv"]},
    install_requires=["torch>=2.3", "numpy", "hydra-core>=1.3", "tensorboard", "tqdm"],
    # Triton is optional: the kernels on a GPU need >= 3.6, the CPU interpreter tests >= 3.9.
    # Without it every op runs its PyTorch path and the kernel tests skip.
    # Tokenized text (data.tokenizer) needs tokenizers; Hugging Face models (bstrain.hf, config=llama_tiny)
    # need transformers too. The tests run both.
    extras_require={"test": ["pytest>=7", "pytest-xdist", "tokenizers", "transformers>=5", "safetensors"],
                    "triton": ["triton>=3.6"], "tokens": ["tokenizers"],
                    "hf": ["tokenizers", "transformers>=5", "safetensors"]},
)
