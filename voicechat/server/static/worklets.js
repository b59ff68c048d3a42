// worklets
