from setuptools import find_packages, setup

setup(
    name="csa_pallas",
    version="0.1.0",
    description="Pallas TPU kernels for the DeepSeek-V4 CSA lightning-indexer distillation loss",
    packages=find_packages(include=["csa_pallas", "csa_pallas.*"]),
    python_requires=">=3.11",
    install_requires=[
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "flax==0.12.8",
        "numpy>=1.26,<3",
        "absl-py>=2.1",
    ],
    extras_require={
        # libtpu (via jax[tpu]) makes v5p AOT compiles possible on a CPU host; the tests rely on it.
        "test": ["pytest==9.2.0", "hypothesis==6.170.17", "matplotlib==3.11.2", "jax[tpu]==0.10.2"],
        "bench": ["matplotlib==3.11.2", "jax[tpu]==0.10.2"],
    },
)
