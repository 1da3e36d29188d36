from .._submodules import submodule_loader

__getattr__ = submodule_loader(__name__)  # package.module after a plain `import draftsman`
