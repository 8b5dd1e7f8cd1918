/* gguf.c */
#include "strata.h"
