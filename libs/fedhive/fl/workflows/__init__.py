"""The built-in workflows, by the import paths a server config names them with:
`fedhive.fl.workflows.ScatterAndGather`, `.FedAvg`, `.Cyclic`, `.CrossSiteModelEval`."""

from fedhive.fl.workflows.cross_site_eval import CrossSiteModelEval
from fedhive.fl.workflows.cyclic import Cyclic
from fedhive.fl.workflows.fedavg import FedAvg
from fedhive.fl.workflows.scatter_and_gather import ScatterAndGather

__all__ = ["CrossSiteModelEval", "Cyclic", "FedAvg", "ScatterAndGather"]
