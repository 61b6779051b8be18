"""Data: offline and `tensorflow_datasets` sources, partitioners, ClientData."""

from tff_privacy.data.federated import FederatedData, client_id, load
from tff_privacy.data.partitioners import PARTITIONS, partition
from tff_privacy.data.sources import DATASETS, Source, load_source
