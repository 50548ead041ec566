from setuptools import find_packages, setup

setup(
    name="ernie_moe",
    version="0.1.0",
    description="PaddlePaddle training for ERNIE-4.5-VL-style heterogeneous multimodal mixture-of-experts models",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ernie_moe", "ernie_moe.*"]),
    # the chat page the server answers at /; the remote code a model folder names in auto_map
    package_data={"ernie_moe.serving": ["page.html"], "ernie_moe.checkpoint": ["hub_code/*.py"]},
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.24,<2",
        "pyyaml>=6",
        "visualdl>=2.5.3",
        "safetensors>=0.4",
        "sentencepiece>=0.2.3",
        "jinja2>=3.1",
        "pillow>=10.1",  # ImageFont.load_default(size=...): the dashboard's heat maps and bar charts
        "tqdm>=4.60",
        "protobuf>=3.20",
        "psutil>=5.9",
    ],
    extras_require={
        # GPU users install paddlepaddle-gpu themselves; the CPU wheel is opt-in so it never replaces it.
        "cpu": ["paddlepaddle==3.3.1"],
        # video files (frame lists need nothing more)
        "video": ["av>=12"],
        # Parquet shards (JSONL and WebDataset tar shards need nothing more)
        "parquet": ["pyarrow>=14"],
        # restarts under Paddle's elastic launcher (python -m ernie_moe.elastic): the etcd client it imports
        "elastic": ["etcd3==0.12.0"],
        # PaddleFormers makes the ERNIE 4.5 checkpoints the interop tests load (pyarrow pinned: see README), and
        # brings transformers, whose ERNIE-4.5-VL (with PEFT for adapters) runs on torch's CPU build in the tests'
        # own processes; the openai client talks to the server in its tests; etcd3 for the elastic launcher's
        # restarts in its tests; mypy checks the package's annotations
        "test": ["pytest>=7", "ruff>=0.5", "mypy==2.4.1", "paddleformers==1.2.0", "pyarrow==25.0.1", "av>=12",
                 "torch==2.13.0", "peft==0.21.2", "openai>=1.40", "etcd3==0.12.0"],
    },
)
