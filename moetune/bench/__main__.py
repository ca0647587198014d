"""``python -m moetune.bench`` (also under ``torchrun -m moetune.bench``)."""

from moetune.bench.cli import main

raise SystemExit(main())
