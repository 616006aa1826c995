"""The federated-learning runtime.

Server side: the server-job process (`server_job`) runs the workflows of an app's
config_fed_server.json (`workflow`), which hand out work through the task API (`controller`,
`task_manager`); the transport to the sites is `task_server`. Site side: the client job's
`worker` loop runs the `executor`s of config_fed_client.json, in process or, through
`client_api_executor`, in a trainer subprocess that uses `fedhive.client`. Both speak `Dxo`s
whose arrays travel as content-addressed tensor refs (`dxo`); the server reads and writes
models tensor by tensor (`model_store`). Built-in workflows, aggregators, persistors:
`workflows`, `aggregators`, `persistors`, `shareables`.
"""

from fedhive.fl.controller import Controller
from fedhive.fl.dxo import DataKind, Dxo, MetaKey
from fedhive.fl.executor import ExecTask, Executor
from fedhive.fl.tasks import ClientTask, CompletionStatus, Result, ReturnCode, SendOrder, Task
from fedhive.fl.workflow import RoundReport, Workflow, WorkflowContext

__all__ = [
    "ClientTask",
    "CompletionStatus",
    "Controller",
    "DataKind",
    "Dxo",
    "ExecTask",
    "Executor",
    "MetaKey",
    "Result",
    "ReturnCode",
    "RoundReport",
    "SendOrder",
    "Task",
    "Workflow",
    "WorkflowContext",
]
