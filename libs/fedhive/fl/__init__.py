"""The federated-learning runtime: the workflow interface (`workflow`) and the server-job
process (`server_job`) that loads an app's config_fed_server.json and runs its workflows."""

from fedhive.fl.workflow import Workflow, WorkflowContext

__all__ = ["Workflow", "WorkflowContext"]
