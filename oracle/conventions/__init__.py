"""How each library speaks attention: layouts, signature presets, merge conventions.

* :mod:`oracle.conventions.layouts` -- layouts and frameworks (``wrap``);
* :mod:`oracle.conventions.layouts_fp4`, :mod:`~oracle.conventions.layouts_latent`,
  :mod:`~oracle.conventions.layouts_sparse` -- the fp4-paged, latent-paged and DSA layouts;
* :mod:`oracle.conventions.signatures` -- signature presets (another library's keywords);
* :mod:`oracle.conventions.signatures_adapt` -- reshaping a preset's call;
* :mod:`oracle.conventions.merge` -- calling conventions of a merge implementation.
"""
