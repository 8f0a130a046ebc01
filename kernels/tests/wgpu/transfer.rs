//! The driver's staged copies (`DriverTransfer`, CUDA only) against CubeCL's own, on lengths
//! around the staging buffer's size: chunk boundaries, a last partial chunk, several chunks.

use sala_kernels::cuda::{DriverTransfer, STAGING_BYTES};
use sala_kernels::{DeviceVec, Transfer};

use crate::common::{client, Rng};

#[test]
fn staged_copies_round_trip_across_chunk_boundaries() {
    let Some(client) = client() else {
        return;
    };
    let transfer = DriverTransfer::new(0).unwrap();
    let words = STAGING_BYTES / 4;
    let mut rng = Rng::new(71);
    for len in [1, 7, words - 1, words, words + 1, 2 * words + words / 2] {
        let data: Vec<f32> = (0..len).map(|_| rng.normal()).collect();
        let up = transfer.upload(&client, &data, 1, len).unwrap();
        assert_eq!(up.download(&client).unwrap(), data, "upload of {len}");
        let v = DeviceVec::upload(&client, &data);
        assert_eq!(
            transfer.download_f32(&client, &v).unwrap(),
            data,
            "download of {len}"
        );
        let codes: Vec<u32> = (0..len as u32)
            .map(|i| i.wrapping_mul(2654435761) >> 24)
            .collect();
        let codes_dev = DeviceVec::upload(&client, &codes);
        assert_eq!(transfer.download_u32(&client, &codes_dev).unwrap(), codes);
        let bytes = codes_dev
            .download_low_bytes_with(&client, &transfer)
            .unwrap();
        assert!(
            bytes.iter().zip(&codes).all(|(&b, &c)| b as u32 == c),
            "bytes of {len}"
        );
    }
}

/// A download of bf16 values from a handle that starts inside its buffer (how a row slice of a
/// tensor arrives: hidden states coming back after a pass) copies from that offset, across
/// chunk boundaries.
#[test]
fn downloads_start_at_the_handle_offset() {
    let Some(client) = client() else {
        return;
    };
    let transfer = DriverTransfer::new(0).unwrap();
    let values = STAGING_BYTES / 2 + 1000;
    let mut rng = Rng::new(72);
    let data: Vec<half::bf16> = (0..values)
        .map(|_| half::bf16::from_f32(rng.normal()))
        .collect();
    let handle = client.create_from_slice(bytemuck::cast_slice(&data));
    for skip in [0, 1, 4096, values - 3] {
        let view = handle.clone().offset_start(2 * skip as u64);
        let mut out = vec![half::bf16::ZERO; values - skip];
        transfer.download_into(&client, &view, &mut out).unwrap();
        assert!(out == data[skip..], "skip {skip}");
    }
}
