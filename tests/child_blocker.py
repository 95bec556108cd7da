"""Source code for a child interpreter that makes one package look uninstalled: every
meta-path finder returns nothing for it, so `import NAME` raises ModuleNotFoundError and
importlib.util.find_spec(NAME) is None. Tests paste it into the script they run with
`python -c`; the child then calls `block()`."""


def blocker_source(name: str) -> str:
    return f'''
class Blocked:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name == {name!r} or name.startswith({name + "."!r}):
            return None
        return self.finder.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.finder, attr)

def block():
    sys.meta_path[:] = [Blocked(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
'''
