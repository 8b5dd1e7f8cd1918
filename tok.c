/* tok.c */
#include "strata.h"
