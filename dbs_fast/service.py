"""The HTTP service at its short path; it lives in `dbs_fast.serving.service`."""
from .serving.service import ServiceOptions, create_app, serve

__all__ = ["ServiceOptions", "create_app", "serve"]
