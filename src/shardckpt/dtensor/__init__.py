"""DTensor: tensors laid out over a device mesh spread across clients (``tf.experimental.dtensor``).

The names match TensorFlow's; the implementation modules are private (``_api``,
``_mesh``, ``_layout``, ``_dvariable``, ``_save``), so the namespace holds the
public API only.
"""

from ._api import (
    DTensor,
    barrier,
    client_id,
    copy_to_mesh,
    default_mesh,
    fetch_layout,
    from_global,
    get_default_mesh,
    is_dtensor,
    num_clients,
    pack,
    relayout,
    to_global,
    unpack,
)
from ._dvariable import DVariable
from ._layout import MATCH, UNSHARDED, Layout
from ._mesh import Mesh, create_distributed_mesh, create_mesh, job_name, local_devices, num_local_devices
from ._save import DTensorCheckpoint, name_based_restore, name_based_save, sharded_save

__all__ = ["Mesh", "Layout", "UNSHARDED", "MATCH", "create_mesh", "create_distributed_mesh", "DTensor", "pack",
           "unpack", "from_global", "to_global", "fetch_layout", "relayout", "copy_to_mesh", "is_dtensor",
           "num_clients", "client_id", "job_name", "num_local_devices", "local_devices", "barrier", "default_mesh",
           "get_default_mesh", "DVariable", "sharded_save", "name_based_save", "name_based_restore",
           "DTensorCheckpoint"]

# the private modules stay importable by path, but not as attributes of the namespace
for _name in ("_api", "_dvariable", "_layout", "_mesh", "_save"):
    globals().pop(_name, None)
del _name
