"""Write the own-data tutorial's files (docs/tutorials/own-data.md) into a folder: an image folder and a CSV table.

    .venv/bin/python examples/make_walkthrough_data.py OUT_DIR

- ``images/train/{zero,one,seven}/`` (120 PNGs each) and ``images/test/...`` (30 each): MNIST digits 0, 1 and 7
  from the MNIST test file (28x28 grey), read from the data root (``DPDRO_DATA_ROOT``, else ../shared/datasets);
- ``new-images/``: 12 more digits in one flat folder, unlabelled (4 of each);
- ``table/train.csv`` (1,500 rows) and ``table/test.csv`` (500): a synthetic risk table, columns
  ``age,income,score,sex,risk`` (risk 'high' or 'low' from a noisy linear score; seed 0);
- ``new-rows.csv``: 20 rows of the same table without the ``risk`` column.

Nothing here is private or real patient data; it exists so that the walk-through's commands run as typed.
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from dpdro.common.config import AUTO
from dpdro.common.data import resolve_data_root
from dpdro.common.errors import DpdroError

DIGITS = {0: "zero", 1: "one", 7: "seven"}
TRAIN_PER_CLASS, TEST_PER_CLASS, NEW_PER_CLASS = 120, 30, 4


def read_mnist_test(root: Path) -> tuple[np.ndarray, np.ndarray]:
    """MNIST's test images (10000, 28, 28) uint8 and labels (10000,) uint8 from root/MNIST/raw/, gzipped (as
    torchvision downloads them) or extracted (as dpdro's cache holds them).
    FileNotFoundError naming the folder when the files are missing."""
    raw = root / "MNIST" / "raw"

    def read(name: str) -> bytes:
        if (raw / f"{name}.gz").exists():
            return gzip.open(raw / f"{name}.gz").read()
        if (raw / name).exists():
            return (raw / name).read_bytes()
        raise FileNotFoundError(f"{raw}: expected {name}[.gz] (set DPDRO_DATA_ROOT to the folder holding MNIST/raw/)")

    x = np.frombuffer(read("t10k-images-idx3-ubyte"), np.uint8, offset=16).reshape(-1, 28, 28)
    y = np.frombuffer(read("t10k-labels-idx1-ubyte"), np.uint8, offset=8)
    return x, y


def write_images(out: Path, x: np.ndarray, y: np.ndarray) -> None:
    for digit, name in DIGITS.items():
        idx = np.flatnonzero(y == digit)
        cut = TRAIN_PER_CLASS + TEST_PER_CLASS
        for split, chosen in (("train", idx[:TRAIN_PER_CLASS]), ("test", idx[TRAIN_PER_CLASS:cut])):
            folder = out / "images" / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in chosen:
                Image.fromarray(x[i]).save(folder / f"{i:05d}.png")
        (out / "new-images").mkdir(parents=True, exist_ok=True)
        for i in idx[cut:cut + NEW_PER_CLASS]:
            Image.fromarray(x[i]).save(out / "new-images" / f"{name}-{i:05d}.png")


def risk_rows(rng: np.random.Generator, n: int) -> list[tuple]:
    """n rows (age, income, score, sex, risk): risk 'high' when 0.05 (age - 54) - income / 50000
    + 4 (score - 0.5) + N(0, 0.7^2) > 0."""
    age, income, score = rng.uniform(18, 90, n), rng.uniform(0, 200_000, n), rng.uniform(0, 1, n)
    z = 0.05 * (age - 54) - income / 50_000 + 4 * (score - 0.5) + rng.normal(0, 0.7, n)
    sex = rng.choice(["f", "m"], n)
    risk = np.where(z > 0, "high", "low")
    return list(zip(age.round(1), income.round(0), score.round(3), sex, risk, strict=True))


def write_table(out: Path) -> None:
    rng = np.random.default_rng(0)
    (out / "table").mkdir(parents=True, exist_ok=True)
    for name, n in (("train.csv", 1500), ("test.csv", 500)):
        lines = ["age,income,score,sex,risk", *(",".join(map(str, r)) for r in risk_rows(rng, n))]
        (out / "table" / name).write_text("\n".join(lines) + "\n")
    lines = ["age,income,score,sex", *(",".join(map(str, r[:4])) for r in risk_rows(rng, 20))]
    (out / "new-rows.csv").write_text("\n".join(lines) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out = Path(argv[0])
    write_table(out)  # needs no data: written even when MNIST is missing
    try:
        x, y = read_mnist_test(resolve_data_root(AUTO))
    except (FileNotFoundError, DpdroError) as e:
        print(f"make_walkthrough_data: wrote {out}/table and {out}/new-rows.csv, but not the images: {e}",
              file=sys.stderr)
        return 1
    write_images(out, x, y)
    print(f"wrote {out}/images (train, test), {out}/new-images, {out}/table (train.csv, test.csv), "
          f"{out}/new-rows.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
