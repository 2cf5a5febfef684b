# Truncate SmolLM2 to its first N blocks (same tensors, same types) so that a
# real-weight decode bench fits one device transfer.
import sys, gguf, numpy as np
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = gguf.GGUFReader(src)
arch = r.fields['general.architecture'].contents()
w = gguf.GGUFWriter(dst, arch)
for name, f in r.fields.items():
    if name.startswith('GGUF.') or name == 'general.architecture':
        continue
    if name == f'{arch}.block_count':
        w.add_uint32(name, n); continue
    t = f.types
    v = f.contents()
    if t[0] == gguf.GGUFValueType.ARRAY:
        w.add_array(name, v)
    elif t[0] == gguf.GGUFValueType.STRING:
        w.add_string(name, v)
    else:
        w.add_key_value(name, v, t[0])
for t in r.tensors:
    if t.name.startswith('blk.') and int(t.name.split('.')[1]) >= n:
        continue
    w.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape, raw_dtype=t.tensor_type)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
