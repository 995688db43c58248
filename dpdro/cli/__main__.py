"""``python -m dpdro.cli``: the ``dpdro`` command."""

import sys

from . import main

sys.exit(main())
