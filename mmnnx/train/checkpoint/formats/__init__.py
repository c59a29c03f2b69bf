"""A checkpoint step's storage formats, one module each behind one interface (``base.py``)."""
