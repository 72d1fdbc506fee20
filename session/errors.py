"""The session layer's error type, shared by the request checks and the memory planner."""


class RequestError(ValueError):
    """A request parameter that cannot be used; `param` names it in SampleConfig/plan terms."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.detail = message
