"""Data: offline and `tensorflow_datasets` sources, partitioners, ClientData."""

from tff_privacy.data import splits
from tff_privacy.data.federated import (CLIENT_DATA, FederatedData, client_id,
                                        from_client_data, load)
from tff_privacy.data.partitioners import PARTITIONS, partition
from tff_privacy.data.sources import DATASETS, Source, load_source
