"""gtopk_plugin: sparse gradient reduction (gTop-k, rTop-k, elastic consistency)
for torch.distributed/DDP, Horovod and BytePS."""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _long_description():
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        return f.read()


EXTRAS = {
    "dev": ["pytest>=7", "pytest-timeout>=2.1", "hypothesis>=6.80", "numpy>=1.24"],
    "demo": ["scikit-learn>=1.2", "tqdm>=4.60", "numpy>=1.24"],
    "bench": ["scikit-learn>=1.2", "tqdm>=4.60", "matplotlib>=3.6", "numpy>=1.24"],
    # Horovod 0.28.1 needs a patched build against current torch: see
    # scripts/install_horovod.sh (issue #3); the extra records the version.
    "horovod": ["horovod==0.28.1"],
    "tf": ["tensorflow-cpu>=2.12"],
    "cuda": ["cupy-cuda12x>=13"],
}
EXTRAS["all"] = sorted({r for k in ("dev", "demo", "bench") for r in EXTRAS[k]})

setup(
    name="gtopk-plugin",
    version="0.1.0",
    description="Sparse gradient reduction (gTop-k, rTop-k, elastic consistency) for slow networks",
    long_description=_long_description(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["gtopk_plugin", "gtopk_plugin.*"]),
    package_data={"gtopk_plugin": ["csrc/**/*"]},
    python_requires=">=3.9",
    # A range that an installed CPU build satisfies; never a bare "torch"
    # (which would pull a multi-GB CUDA build on a fresh machine).
    install_requires=["torch>=2.1", "numpy>=1.24"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["gtopk-demo=gtopk_plugin.demo:main"]},
)
