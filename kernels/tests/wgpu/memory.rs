//! Transfers and device-filled zeros: values survive the round trip bit for bit, and `zeros`
//! really is zero when the memory pool hands back a buffer that held other values.

use sala_kernels::{DeviceVec, MatrixView};

use crate::common::{client, Rng};

#[test]
fn uploads_round_trip_bit_for_bit() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(3);
    let mut values = rng.vec(1000);
    values.extend([f32::MIN_POSITIVE / 2.0, -0.0, f32::MAX, f32::NEG_INFINITY]);
    let back = DeviceVec::upload(&client, &values)
        .download(&client)
        .unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&back), bits(&values));
    let codes: Vec<u32> = (0..777u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    assert_eq!(
        DeviceVec::upload(&client, &codes)
            .download(&client)
            .unwrap(),
        codes
    );
    assert!(DeviceVec::<f32>::upload(&client, &[])
        .download(&client)
        .unwrap()
        .is_empty());
}

#[test]
fn zeros_are_zero_even_in_reused_memory() {
    let Some(client) = client() else {
        return;
    };
    for round in 0..4 {
        let len = 4096 + 3 * round;
        // Fill the pool with non-zero buffers of the same size, then free them.
        for _ in 0..3 {
            drop(DeviceVec::upload(&client, &vec![u32::MAX; len]));
        }
        let codes = DeviceVec::<u32>::zeros(&client, len).unwrap();
        assert_eq!(codes.download(&client).unwrap(), vec![0u32; len]);
        let m = MatrixView::zeros(&client, 7, len / 7).unwrap();
        assert!(m
            .download(&client)
            .unwrap()
            .iter()
            .all(|&v| v.to_bits() == 0));
    }
    assert!(DeviceVec::<f32>::zeros(&client, 0)
        .unwrap()
        .download(&client)
        .unwrap()
        .is_empty());
}

/// The codes' byte download (four per word on the device) against the plain `u32` download,
/// on lengths around the word size; only the low byte of each element comes back.
#[test]
fn low_bytes_download_equals_the_u32_download_narrowed() {
    let Some(client) = client() else {
        return;
    };
    let mut rng = Rng::new(11);
    for len in [0usize, 1, 3, 4, 5, 8, 1001, 4099] {
        let values: Vec<u32> = (0..len).map(|_| rng.next_u64() as u32 % 300).collect();
        let device = DeviceVec::upload(&client, &values);
        let narrowed: Vec<u8> = device
            .download(&client)
            .unwrap()
            .iter()
            .map(|&v| v as u8)
            .collect();
        assert_eq!(
            device.download_low_bytes(&client).unwrap(),
            narrowed,
            "len {len}"
        );
    }
}
