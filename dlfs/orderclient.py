"""The public name of the order socket's client: `dlfs.orderclient.connect(paths)`.

Other frameworks announce their epochs with it (docs/ORDER.md); it lives in
dlfs.order.client, and this module only re-exports its public names
(tests/test_layering.py allows nothing else here).
"""

from dlfs.order.client import OrderClient, OrderClientError, connect

__all__ = ["OrderClient", "OrderClientError", "connect"]
