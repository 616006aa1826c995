"""fedhive.auth: who an admin is (bearer tokens, stored hashed) and what each role may do.

* `fedhive.auth.tokens`: `new_token()`, `hash_token()`, `AdminDirectory.load(path)` and
  `authenticate(token) -> Admin`.
* `fedhive.auth.policy`: the authorisation policy as one table (`POLICY`) and the one function
  that decides (`decide`), after FLARE's default policy.
"""

from fedhive.auth.policy import POLICY, Action, Condition, Decision, Right, Role, decide, denial
from fedhive.auth.tokens import Admin, AdminDirectory, hash_token, new_token

__all__ = [
    "POLICY",
    "Action",
    "Admin",
    "AdminDirectory",
    "Condition",
    "Decision",
    "Right",
    "Role",
    "decide",
    "denial",
    "hash_token",
    "new_token",
]
