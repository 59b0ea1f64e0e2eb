"""sd-scripts' networks.loha (LoHa) as a kohya network module (see networks/loha_lokr.py for the
network_args and networks/adapter_modules.py LoHaModule for the tensors)."""
from __future__ import annotations

from networks import loha_lokr

MODULE = "networks.loha"

check_network_args, create_network, create_network_from_weights = loha_lokr.entry_points(MODULE)
