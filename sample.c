/* sample.c */
#include "strata.h"
